"""FSDP2 communication of one optimizer step: dion3_megatron's Dion3 against microsoft/dion.

Layout: FSDP2 (``fully_shard``) on a 1-D mesh of W ranks; every matrix a DTensor sharded by rows
(``Shard(0)``, ``torch.chunk``'s cut: ceil(n / W) rows per rank). Per rank and optimizer step:
the collectives, the bytes the rank sends to the other ranks, and the time from comm_model.py's
alpha-beta constants (one alpha per collective, the busiest rank's bytes over beta). What every
optimizer shares is left out: FSDP2's all-gather of parameters and reduce-scatter of gradients,
and the AdamW tensors (embeddings, norms), which take no collective in any of them.

  dion3_megatron Dion3: one all-reduce of a flag (the non-finite gate), one all-reduce of every
    shape's fp32 row scores; per shape group one all-to-all of the selected rows (k = ceil(f n),
    chosen over the whole matrix) to their owners (matrix j -> rank j mod W) and one back, fp32,
    each row with its variance. On 2 ranks while k * 2 <= n a row block sends all k rows (zeros
    for the other rank's: the static exchange); otherwise only the selected rows it holds.
  microsoft/dion NorDion2 (``Dion3`` there is an alias), selection_scope="local" (its default):
    each rank takes the top k_loc = ceil(f ceil(n / W)) rows of its own shard; per shape group one
    all-to-all of them (bf16, the batch padded to a multiple of W) and one back. No collective
    for scores. With selection_scope="global" the whole shards travel (bf16) and the top k is
    taken on the assembled matrix.
  microsoft/dion Muon: per shape group one all-to-all of the whole bf16 shards and one back.

What is modelled and what is measured: the collectives (kind, count, elements per destination,
dtype) of every path are modelled from the code (microsoft/dion's from dion/megabatch_base.py,
dion/nordion2.py, dion/dion2.py, dion/muon.py at commit 0a059a4542e5aa74b40dcd1dce363836c7afcd48)
and --measure records them on a small case (tests/unit/test_comm_fsdp2.py does so for dion3_megatron
at 2 and 4 ranks): they are equal, rank by rank. For the table the selected rows are taken as
spread evenly over the shards (the engine sends only those a rank holds). Times are modelled
only: alpha and beta are NCCL figures between two H200s; links between nodes at 16 to 64 ranks
are slower.

  python benchmarks/comm_fsdp2.py                        # the table: 1B .. 100B, W = 8 .. 64, f = 1/4
  python benchmarks/comm_fsdp2.py --fraction 0.125 --json out.json
  torchrun --standalone --nproc-per-node 4 benchmarks/comm_fsdp2.py --measure [--dion-path DIR]
      # on CPU over gloo: record every collective of a step and compare with the model, for
      # dion3_megatron and, when microsoft/dion is importable (DIR: its checkout), for its three paths
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from benchmarks.comm_model import ALPHA_S, BETA_BYTES_PER_S, CONFIGS, ModelConfig, _by_shape  # noqa: E402
from dion3_megatron.core.rule import selected_row_count  # noqa: E402
from dion3_megatron.engine.static import STATIC_ROW_BLOCKS_MAX_WORLD  # noqa: E402
from examples.leave_process_group import leave_process_group  # noqa: E402

FP32, BF16 = 4, 2
WORLDS = (8, 16, 32, 64)


@dataclass(frozen=True)
class Collective:
    """One collective as one rank makes it. ``kind``: "all_reduce" or "all_to_all"; ``elements``:
    the all-reduce's length, or the all-to-all's elements for each destination rank (this rank's
    own share included: it stays here); ``itemsize``: bytes per element."""

    kind: str
    elements: tuple
    itemsize: int
    what: str

    def bytes_sent(self, rank: int, world: int) -> float:
        """Bytes leaving the rank: a ring all-reduce sends 2 (W-1)/W of its length; an all-to-all
        everything but its own share."""
        if self.kind == "all_reduce":
            return 2 * (world - 1) / world * self.elements[0] * self.itemsize
        return (sum(self.elements) - self.elements[rank]) * self.itemsize


def shape_groups(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """(rows, cols, matrices) of every shape in the model: under FSDP2 every rank steps all of them."""
    matrices = [(shape, split) for shape, split, _ in cfg.layer_matrices()] * cfg.layers
    return [(n, m, count) for (n, m), count in _by_shape(matrices).items()]


def row_counts(n: int, world: int) -> list[int]:
    """Rows of each rank's shard as Shard(0) cuts them (torch.chunk: ceil(n / W) each, the last fewer)."""
    chunk = math.ceil(n / world)
    return [max(0, min(n, (q + 1) * chunk) - min(n, q * chunk)) for q in range(world)]


def dion3_megatron_step(
    groups: Sequence[tuple[int, int, int]],
    world: int,
    fraction: float,
    rank: int,
    selected: Optional[dict[tuple[int, int], Sequence[int]]] = None,
) -> list[Collective]:
    """dion3_megatron's collectives on ``rank`` for shape groups (n, m, B) of row shards over
    ``world`` ranks. ``selected[(n, m)]``: the rows chosen in every matrix of that group (the
    engine sends only those a rank holds); not given, they are spread evenly over the shards
    (k rows_q / n on rank q, a fraction)."""
    out = [
        Collective("all_reduce", (1,), FP32, "non-finite gate"),
        Collective("all_reduce", (sum(n * b for n, _, b in groups),), FP32, "row scores, all shapes"),
    ]
    for n, m, b in groups:
        k = selected_row_count(n, fraction)
        owned = [len(range(d, b, world)) for d in range(world)]  # matrix j -> rank j mod W
        rows = row_counts(n, world)
        if world <= STATIC_ROW_BLOCKS_MAX_WORLD and k * world <= n:  # static: all k rows, zeros elsewhere
            held = [k] * world
        elif selected is not None and (n, m) in selected:
            held = [sum(1 for r in selected[n, m] if sum(rows[:q]) <= r < sum(rows[: q + 1])) for q in range(world)]
        else:
            held = [k * rows[q] / n for q in range(world)]
        # Out: my pieces of the chosen rows of each owner's matrices; back: to each rank, its pieces
        # of my matrices' rows. A row travels with its variance (m + 1 values).
        forward = tuple(owned[d] * held[rank] * (m + 1) for d in range(world))
        back = tuple(owned[rank] * held[d] * (m + 1) for d in range(world))
        out += [
            Collective("all_to_all", forward, FP32, f"{n}x{m} rows to owners"),
            Collective("all_to_all", back, FP32, f"{n}x{m} results back"),
        ]
    return out


def microsoft_step(groups: Sequence[tuple[int, int, int]], world: int, fraction: Optional[float]) -> list[Collective]:
    """microsoft/dion's collectives on any rank (they are alike): NorDion2 with
    selection_scope="local" for a fraction, its whole-shard exchange (NorDion2 "global", Muon)
    for ``fraction=None``. Per shape group the batch is padded to a multiple of W and every shard
    to the same rows (megabatch_orthogonalize_async); one all-to-all out and one back, bf16."""
    out = []
    for n, m, b in groups:
        padded_rows = math.ceil(n / world)
        rows = padded_rows if fraction is None else max(1, math.ceil(fraction * padded_rows))
        per_rank = math.ceil(b / world)
        chunk = (per_rank * rows * m,) * world
        out += [
            Collective("all_to_all", chunk, BF16, f"{n}x{m} shards to owners"),
            Collective("all_to_all", chunk, BF16, f"{n}x{m} results back"),
        ]
    return out


def summary(per_rank: Sequence[list[Collective]], world: int) -> dict:
    """Rounds, the busiest rank's bytes sent, and alpha-beta time."""
    rounds = len(per_rank[0])
    sent = max(sum(c.bytes_sent(q, world) for c in collectives) for q, collectives in enumerate(per_rank))
    return {"rounds": rounds, "bytes": sent, "comm_s": rounds * ALPHA_S + sent / BETA_BYTES_PER_S}


def compare(cfg: ModelConfig, world: int, fraction: float) -> dict:
    groups = shape_groups(cfg)
    return {
        "model": cfg.name,
        "world": world,
        "fraction": fraction,
        "shape_groups": len(groups),
        "dion3_megatron": summary([dion3_megatron_step(groups, world, fraction, q) for q in range(world)], world),
        "microsoft_nordion2_local": summary([microsoft_step(groups, world, fraction)], world),
        # NorDion2's "global" scope and Muon make the same exchange: whole bf16 shards.
        "microsoft_whole_shards": summary([microsoft_step(groups, world, None)], world),
    }


DENSE = [cfg for cfg in CONFIGS if not cfg.experts]


def table(fraction: float = 0.25, worlds: Sequence[int] = WORLDS) -> list[dict]:
    return [compare(cfg, world, fraction) for cfg in DENSE for world in worlds]


COLUMNS = [
    ("dion3_megatron", "dion3_megatron"),
    ("microsoft_nordion2_local", "NorDion2 local"),
    ("microsoft_whole_shards", "NorDion2 global = Muon"),
]


def render(rows: list[dict]) -> list[str]:
    fraction = rows[0]["fraction"]
    lines = [
        "FSDP2, 1-D mesh of W ranks, every matrix Shard(0); per rank per optimizer step (busiest rank):",
        "rounds = collectives, MB = MiB sent to other ranks, ms = rounds * alpha + bytes / beta (modelled).",
        f"f = {fraction} (ours and microsoft/dion NorDion2); alpha {ALPHA_S * 1e6:.0f} us, "
        f"beta {BETA_BYTES_PER_S / 1e9:.0f} GB/s; microsoft/dion at 0a059a45.",
        f"{'model':<6}{'W':>4} |" + "|".join(f"{label:>24} " for _, label in COLUMNS),
        f"{'':<6}{'':>4} |" + "|".join(f"{'rounds':>8}{'MB':>9}{'ms':>7} " for _ in COLUMNS),
    ]
    for row in rows:
        cells = [f"{row[key]['rounds']:>8}{row[key]['bytes'] / 2**20:>9.1f}{row[key]['comm_s'] * 1e3:>7.2f} " for key, _ in COLUMNS]
        lines.append(f"{row['model']:<6}{row['world']:>4} |" + "|".join(cells))
    return lines


# --------------------------------------------------------------------------------------------
# Measured: every collective of one step on DTensor row shards, recorded as the model states them.

# (rows, cols, matrices) and the rows each gradient makes the top ones (dion3_megatron sends only
# the chosen rows a rank holds). f = 1/2: (16, 8) takes the static exchange at 2 ranks, (7, 6) the
# planned one (k * 2 > 7); at 4 ranks both are planned, (7, 6) with a short last shard (2, 2, 2, 1
# rows); 3 and 2 matrices leave ranks that own none.
SMALL_GROUPS = [(16, 8, 3), (7, 6, 2)]
SMALL_CHOSEN = {(16, 8): (0, 1, 4, 5, 8, 9, 12, 13), (7, 6): (0, 2, 4, 6)}
SMALL_FRACTION = 0.5
PATHS = ("dion3_megatron", "nordion2_local", "nordion2_global", "muon")
_COLLECTIVES = (
    "all_reduce",
    "all_to_all_single",
    "all_to_all",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "barrier",
)


def predicted_small(path: str, world: int, rank: int) -> list[tuple]:
    """The model's collectives of the small case, as :func:`recorded_step` records them."""
    if path == "dion3_megatron":
        collectives = dion3_megatron_step(SMALL_GROUPS, world, SMALL_FRACTION, rank, selected=SMALL_CHOSEN)
    else:
        collectives = microsoft_step(SMALL_GROUPS, world, SMALL_FRACTION if path == "nordion2_local" else None)
    return [(c.kind, tuple(int(e) for e in c.elements), c.itemsize) for c in collectives]


def _small_gradients(step: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(100 + step)
    grads = []
    for n, m, b in SMALL_GROUPS:
        for _ in range(b):
            g = 0.01 * torch.randn(n, m, generator=gen)
            g[list(SMALL_CHOSEN[n, m])] += 10.0
            grads.append(g)
    return grads


def _optimizer(path: str, params: list, mesh):
    import torch

    if path == "dion3_megatron":
        from dion3_megatron import Dion3

        return Dion3(params, lr=0.01, fraction=SMALL_FRACTION, ns_dtype=torch.float32)
    compile_ = torch.compile  # microsoft/dion compiles some steps; eager makes the same collectives
    torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
    try:
        from dion import Muon, NorDion2
    finally:
        torch.compile = compile_
    if path == "muon":
        return Muon(params, distributed_mesh=mesh)
    return NorDion2(params, distributed_mesh=mesh, fraction=SMALL_FRACTION, selection_scope=path.split("_")[1])


def recorded_step(rank: int, world: int, path: str) -> dict:
    """Under an initialized gloo process group: ``path``'s optimizer steps the small case's DTensor
    matrices (Shard(0) on a 1-D mesh) twice; every torch.distributed collective of the second step
    (the first also builds state) as (kind, elements per destination or length, bytes per element)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(distribute_tensor(torch.randn(n, m, generator=gen), mesh, [Shard(0)]))
        for n, m, b in SMALL_GROUPS
        for _ in range(b)
    ]
    opt = _optimizer(path, params, mesh)
    record: list[tuple] = []

    def recording(name, original):
        def call(*args, **kwargs):
            if name == "all_to_all_single":
                send, splits = args[1], args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
                splits = splits or [send.numel() // world] * world
                record.append(("all_to_all", tuple(splits), send.element_size()))
            elif name == "all_to_all":
                record.append(("all_to_all", tuple(t.numel() for t in args[1]), args[1][0].element_size()))
            elif name == "all_reduce":
                record.append(("all_reduce", (args[0].numel(),), args[0].element_size()))
            else:
                record.append((name,))
            return original(*args, **kwargs)

        return call

    for step in range(2):
        for p, g in zip(params, _small_gradients(step)):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        originals = {name: getattr(dist, name) for name in _COLLECTIVES}
        if step == 1:
            for name, original in originals.items():
                setattr(dist, name, recording(name, original))
        try:
            opt.step()
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
    engine = opt._whole.session.engine
    return {"record": record, "collectives": list(engine.collectives) if engine is not None else None}


def measure(dion_path: Optional[str]) -> None:
    """Under torchrun with gloo: record each path's step, compare with the model on every rank."""
    import torch.distributed as dist

    if dion_path:
        sys.path.insert(0, dion_path)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import dion  # noqa: F401

        paths = PATHS
    except ImportError:
        paths = PATHS[:1]
    lines, agree = [], True
    for path in paths:
        got = recorded_step(rank, world, path)["record"]
        same = sorted(got) == sorted(predicted_small(path, world, rank))
        everyone: list = [None] * world
        dist.all_gather_object(
            everyone,
            (
                same,
                len(got),
                sum((2 * (world - 1) / world * e[0] if kind == "all_reduce" else sum(e) - e[rank]) * size for kind, e, size in got),
            ),
        )
        equal = all(s for s, _, _ in everyone)
        agree = agree and equal
        verdict = "equal to the model" if equal else "DIFFERENT from the model"
        lines.append(f"{path:<16} collectives {everyone[0][1]:>2}, bytes sent per rank {[int(b) for _, _, b in everyone]}: {verdict}")
    if rank == 0:
        print(f"measured on gloo, {world} ranks, {SMALL_GROUPS} (rows, cols, matrices), f = {SMALL_FRACTION}")
        print("\n".join(lines) + ("" if len(paths) > 1 else "\n(microsoft/dion not importable: pass --dion-path)"))
    leave_process_group()
    if not agree:
        sys.exit(1)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--json", help="also write the table and the command here")
    parser.add_argument("--measure", action="store_true", help="under torchrun: record a small case's collectives")
    parser.add_argument("--dion-path", help="with --measure: a checkout of microsoft/dion to import")
    args = parser.parse_args(argv)
    if args.measure:
        measure(args.dion_path)
        return
    rows = table(args.fraction)
    lines = render(rows)
    print("\n".join(lines))
    if args.json:
        command = "python benchmarks/comm_fsdp2.py" + (f" --fraction {args.fraction}" if args.fraction != 0.25 else "")
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": command,
                    "kind": "modelled (alpha-beta), not measured",
                    "layout": "FSDP2 fully_shard, 1-D mesh of W ranks, every matrix Shard(0)",
                    "microsoft_dion_commit": "0a059a4542e5aa74b40dcd1dce363836c7afcd48",
                    "alpha_s": ALPHA_S,
                    "beta_bytes_per_s": BETA_BYTES_PER_S,
                    "printed": lines,
                    "rows": rows,
                },
                f,
                indent=1,
            )
            f.write("\n")


if __name__ == "__main__":
    main()
