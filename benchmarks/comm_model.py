"""Communication and time model of one optimizer step: Dion3 megabatched vs one-matrix-at-a-time Muon.

For a GPT config and a parallel layout (TP, PP, DP with ZeRO-1 layer-wise ownership, EP), per rank
and per optimizer step: collective rounds, bytes sent, and a predicted time from an alpha-beta
model (alpha: latency per collective, beta: bytes per second) plus orthogonalization FLOPs at a
sustained rate. What both optimizers share (Megatron's all-gather of updated params across data
parallel) is left out: the model compares what differs.

  Dion3: one all-reduce of every shape's row scores, then per distinct (shape, TP group) one
    all-to-all of the selected rows to owner ranks and one back; each rank orthogonalizes
    ceil(B/TP) blocks of k x cols.
  Muon "duplicated" (Megatron's default for TP): per matrix an all-gather of the momentum shard,
    then standard NS5 on the whole matrix on every TP rank.

  python benchmarks/comm_model.py                 # the scaling table (8 .. 4096 GPUs, 1B .. 100B)
  python benchmarks/comm_model.py --check results.json   # compare with bench_megabatch.py's JSON
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from dion3_megatron.core.ortho import ns_flops
from dion3_megatron.engine.static import STATIC_ROW_BLOCKS_MAX_WORLD

# The model's constants for two H200s over NVLink with NCCL (docs/scaling.md states them). Chosen,
# not measured here: the latency of one collective, the bandwidth of a large one (512 MiB in
# 0.94 ms), the device-memory bandwidth of the element-wise passes over the rank's matrices
# (momentum, scores, gathers, weight update) and the launch and Python cost of one eager op.
ALPHA_S = 43e-6
BETA_BYTES_PER_S = 512 * 2**20 / 0.94e-3
HBM_BYTES_PER_S = 4.3e12
LAUNCH_S = 8e-6
# The sustained NS rate: plain-torch Keller NS5 on 5120 x 13824 on one H200, 13.79 ms for 8.6 TFLOP
# of dense products (benchmarks/results/gram-ns-h200.json: 623 TFLOP/s), rounded down.
NS_FLOPS_PER_S = 620e12
# Bytes moved in device memory per matrix element and step: Dion3 reads/writes the momentum, the
# gradient, the scores and the weight (~24 B) plus ~40 B per selected element (gather, normalize,
# scatter); Muon ~24 B (momentum, weight) plus the all-gathered copy and NS operands (~16 B).
DION3_BYTES_PER_ELEMENT = (24, 40)
MUON_BYTES_PER_ELEMENT = 40
# Eager ops per matrix: Dion3 ~6 (momentum, index math, update) plus ~60 per shape group;
# Muon ~25 (5 NS steps of 3 products and 2 element-wise ops, momentum, update).
DION3_OPS = (6, 60)
MUON_OPS = 25


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    ffn: int
    experts: int = 0  # MoE experts per layer (each with its own fc1/fc2 of size ffn)

    def layer_matrices(self) -> list[tuple[tuple[int, int], str, bool]]:
        """(logical shape, TP split, is_expert) for one layer; Q, K, V and gate/up split apart."""
        h, f = self.hidden, self.ffn
        attention = [((h, h), "rows", False)] * 3 + [((h, h), "cols", False)]
        mlp = [((f, h), "rows"), ((f, h), "rows"), ((h, f), "cols")]  # SwiGLU: gate, up, down
        if self.experts:
            return attention + [(shape, split, True) for shape, split in mlp] * self.experts
        return attention + [(shape, split, False) for shape, split in mlp]

    @property
    def matrix_params(self) -> int:
        return self.layers * sum(n * m for (n, m), _, _ in self.layer_matrices())


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


def owned_matrices(cfg: ModelConfig, layout: Layout) -> list[tuple[tuple[int, int], str]]:
    """Matrices one rank steps: its pipeline stage's, its experts', its 1/DP share (ZeRO-1)."""
    layers = math.ceil(cfg.layers / layout.pp)
    stage = []
    for shape, split, expert in cfg.layer_matrices():
        stage += [(shape, split, expert)] * layers
    dense = [(s, sp) for s, sp, e in stage if not e]
    experts = [(s, sp) for s, sp, e in stage if e]
    experts = experts[: math.ceil(len(experts) / layout.ep)]
    expert_dp = max(1, layout.dp // layout.ep)
    return dense[:: layout.dp] + experts[::expert_dp]


def _by_shape(matrices):
    groups: dict[tuple[int, int], int] = {}
    for shape, _ in matrices:
        groups[shape] = groups.get(shape, 0) + 1
    return groups


def dion3_step(cfg: ModelConfig, layout: Layout, fraction: float) -> dict:
    w = layout.tp
    rounds = nbytes = flops = memory = ops = 0.0
    owned = owned_matrices(cfg, layout)
    for (n, m), count in _by_shape(owned).items():
        k = max(1, math.ceil(fraction * n))
        if w > 1:
            rounds += 2  # the all-to-alls; the scores of all shapes share one all-reduce (below)
            nbytes += 2 * (w - 1) / w * count * n * 4  # ring all-reduce of fp32 row scores
            # Selected rows out and back: a column block sends its columns of all k rows; a row
            # block sends k rows too (zeros for rows held elsewhere) on the static exchange (2
            # ranks, k * w <= n: exchange._static_exchange), else only the ~k / w rows it holds.
            row_blocks = sum(1 for shape, split in owned if shape == (n, m) and split == "rows")
            padded = row_blocks if w <= STATIC_ROW_BLOCKS_MAX_WORLD and k * w <= n else 0
            nbytes += 2 * (w - 1) / w * ((count - padded) * k * m / w + padded * k * m) * 4
        flops += math.ceil(count / w) * ns_flops(k, m, "gram")
        per_element, per_selected = DION3_BYTES_PER_ELEMENT
        memory += count * n * m / w * (per_element + per_selected * k / n)
        ops += count * DION3_OPS[0] + DION3_OPS[1]
    rounds += 1 if rounds else 0
    return _timed(rounds, nbytes, flops, memory, ops)


def dense_ns5_flops(s: int, length: int) -> float:
    """Matmul FLOPs of Keller's NS5 on an s x L matrix (s <= L), every product dense: per step
    X X^T and B X (2 s^2 L each) and A A (2 s^3)."""
    return 5 * (4 * s * s * length + 2 * s**3)


def muon_step(cfg: ModelConfig, layout: Layout) -> dict:
    w = layout.tp
    rounds = nbytes = flops = memory = ops = 0.0
    for (n, m), count in _by_shape(owned_matrices(cfg, layout)).items():
        if w > 1:
            rounds += count
            nbytes += (w - 1) / w * count * n * m * 4  # all-gather of each fp32 momentum shard
        s, length = min(n, m), max(n, m)
        flops += count * dense_ns5_flops(s, length)  # every TP rank, every matrix
        memory += count * n * m * MUON_BYTES_PER_ELEMENT
        ops += count * MUON_OPS
    return _timed(rounds, nbytes, flops, memory, ops)


def _timed(rounds: float, nbytes: float, flops: float, memory: float, ops: float) -> dict:
    comm = rounds * ALPHA_S + nbytes / BETA_BYTES_PER_S
    compute = flops / NS_FLOPS_PER_S + memory / HBM_BYTES_PER_S + ops * LAUNCH_S
    return {"rounds": int(rounds), "bytes": nbytes, "comm_s": comm, "compute_s": compute, "total_s": comm + compute}


CONFIGS = [
    ModelConfig("1B", 24, 2048, 5504),
    ModelConfig("8B", 32, 4096, 14336),
    ModelConfig("14B", 40, 5120, 13824),
    ModelConfig("70B", 80, 8192, 28672),
    ModelConfig("100B", 96, 10240, 32768),
    ModelConfig("MoE-16x", 24, 2048, 1408, experts=16),
]


def layout_for(gpus: int, cfg: ModelConfig) -> Layout:
    """TP within a node (8), PP for the larger models, the rest data parallel."""
    tp = min(8, gpus)
    pp = 1 if cfg.matrix_params < 20e9 else (4 if cfg.matrix_params < 80e9 else 8)
    pp = min(pp, max(1, gpus // tp))
    return Layout(tp, pp, max(1, gpus // (tp * pp)), ep=min(8, cfg.experts) if cfg.experts else 1)


def table(fractions=(0.25, 0.125)) -> list[dict]:
    rows = []
    for cfg in CONFIGS:
        for gpus in (8, 64, 512, 4096):
            layout = layout_for(gpus, cfg)
            muon = muon_step(cfg, layout)
            row = {"model": cfg.name, "gpus": gpus, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "muon": muon}
            for f in fractions:
                row[f"dion3_{f}"] = dion3_step(cfg, layout, f)
            rows.append(row)
    return rows


def check(measured_path: str) -> None:
    """Predicted vs measured step time for bench_megabatch.py's layer set at its TP size."""
    with open(measured_path) as f:
        measured = json.load(f)
    layout = Layout(measured["world"], 1, 1)
    hidden, ffn, layers = measured["hidden"], measured["ffn"], measured["layers"]

    class BenchConfig(ModelConfig):  # the benchmark's layer: Q, K, V, proj, fc1, fc2 (no SwiGLU)
        def layer_matrices(self):
            h, f = self.hidden, self.ffn
            return [((h, h), "rows", False)] * 3 + [((h, h), "cols", False), ((f, h), "rows", False), ((h, f), "cols", False)]

    cfg = BenchConfig("bench", layers, hidden, ffn)
    print(f"{'optimizer':<16}{'predicted ms':>14}{'measured ms':>13}{'error':>8}")
    pairs = [("muon", muon_step(cfg, layout)["total_s"] * 1e3, measured["muon_ms"])]
    for fraction, r in measured["dion3"].items():
        pairs.append((f"dion3 f={fraction}", dion3_step(cfg, layout, float(fraction))["total_s"] * 1e3, r["ms"]))
    for name, predicted, got in pairs:
        print(f"{name:<16}{predicted:>14.2f}{got:>13.2f}{(predicted - got) / got:>8.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", help="bench_megabatch.py --json output to compare against")
    args = parser.parse_args()
    if args.check:
        check(args.check)
        return
    print(f"alpha {ALPHA_S * 1e6:.0f} us, beta {BETA_BYTES_PER_S / 1e9:.0f} GB/s, NS rate {NS_FLOPS_PER_S / 1e12:.0f} TFLOP/s")
    print(
        f"{'model':<9}{'GPUs':>6}{'TPxPPxDP':>12} | {'muon rounds':>11}{'MB':>9}{'ms':>8} | "
        f"{'dion3 1/4 rounds':>16}{'MB':>8}{'ms':>8} | {'1/8 MB':>7}{'ms':>7} | {'speedup 1/4':>11}"
    )
    for row in table():
        muon, d4, d8 = row["muon"], row["dion3_0.25"], row["dion3_0.125"]
        print(
            f"{row['model']:<9}{row['gpus']:>6}{row['tp']:>5}x{row['pp']}x{row['dp']:<4} | {muon['rounds']:>11}"
            f"{muon['bytes'] / 2**20:>9.0f}{muon['total_s'] * 1e3:>8.1f} | {d4['rounds']:>16}{d4['bytes'] / 2**20:>8.0f}"
            f"{d4['total_s'] * 1e3:>8.1f} | {d8['bytes'] / 2**20:>7.0f}{d8['total_s'] * 1e3:>7.1f} | "
            f"{muon['total_s'] / d4['total_s']:>10.1f}x"
        )


if __name__ == "__main__":
    main()
