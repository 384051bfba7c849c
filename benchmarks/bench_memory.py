"""Optimizer state per parameter: Dion3's front ends against AdamW (fp32 and bf16 moments) and Muon.

A Llama-shaped model (:class:`Shapes`: 4 layers of width 1024, grouped-query attention, a SwiGLU
MLP, RMSNorms, a tied 32000-token embedding) takes one training step in each case: the hidden
matrices (Q, K, V, O and the MLP's three) the case's matrix optimizer, the embedding and the norms
AdamW. After the step and ``zero_grad()``, what the optimizer holds between steps is counted: its
state (``optimizer.state``) and, through the optimizer's own objects, the buffers of Dion3's engine.
A state tensor is often a view of an engine buffer, so what is counted is each distinct storage,
once; the weights and the gradients the optimizer was handed (the model's, and the flat partitions
DeepSpeed hands its optimizer) are left out, unless the optimizer keeps a gradient after the step.
Reported per case: the bytes per parameter of the whole model, and per parameter of the hidden
matrices (the bytes held for them: everything but what the embedding's and norms' state holds).

Cases are :data:`CASES`, a list of :class:`Case`; one line adds another (an option of a front
end, another optimizer). AdamW with bf16 moments is torchtitan's ``fused_opt_states_bf16``: the
state its step pre-hook makes (its fused mixed-precision step needs CUDA, so here the hook runs
alone). DeepSpeed runs in this process at ZeRO-1 over gloo with world size 1, its accelerator the
CPU.

  python benchmarks/bench_memory.py [--json benchmarks/results/memory-cpu.json] [--page docs/memory.md]
"""

from __future__ import annotations

import argparse
import datetime
import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dion3_megatron import Dion3  # noqa: E402

FRACTION = 0.25
TOKENS = 64  # one sequence: enough for every parameter to have a gradient


@dataclass(frozen=True)
class Shapes:
    vocab: int = 32000
    width: int = 1024
    layers: int = 4
    heads: int = 16
    kv_heads: int = 4
    hidden: int = 2816  # the SwiGLU MLP's: about 8/3 of the width, a multiple of 256


class Block(torch.nn.Module):
    def __init__(self, s: Shapes) -> None:
        super().__init__()
        head = s.width // s.heads
        self.heads, self.kv_heads = s.heads, s.kv_heads
        self.attention_norm, self.mlp_norm = torch.nn.RMSNorm(s.width), torch.nn.RMSNorm(s.width)
        self.q, self.o = torch.nn.Linear(s.width, s.width, bias=False), torch.nn.Linear(s.width, s.width, bias=False)
        self.k = torch.nn.Linear(s.width, s.kv_heads * head, bias=False)
        self.v = torch.nn.Linear(s.width, s.kv_heads * head, bias=False)
        self.w1 = torch.nn.Linear(s.width, s.hidden, bias=False)
        self.w3 = torch.nn.Linear(s.width, s.hidden, bias=False)
        self.w2 = torch.nn.Linear(s.hidden, s.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attention_norm(x)
        q = self.q(h).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = (f(h).view(b, t, self.kv_heads, -1).transpose(1, 2) for f in (self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(torch.nn.Module):
    def __init__(self, s: Shapes) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(s.vocab, s.width)
        self.blocks = torch.nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = torch.nn.RMSNorm(s.width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.embed.weight.T  # the output head tied to the embedding
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def is_matrix(name: str, p: torch.Tensor) -> bool:
    """The hidden matrices: what Dion3 and Muon step (the embedding and the norms take AdamW)."""
    return name.startswith("blocks.") and p.dim() == 2


def split(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    named = list(model.named_parameters())
    return [(n, p) for n, p in named if is_matrix(n, p)], [(n, p) for n, p in named if not is_matrix(n, p)]


def tokens(s: Shapes) -> torch.Tensor:
    return torch.randint(0, s.vocab, (1, TOKENS), generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------------------------
# The cases: each builds its optimizer on a fresh model, takes one step and hands back what to count.


@dataclass
class Stepped:
    """An optimizer after its first step: ``holders``, the objects whose tensors are its (the
    optimizers; a Dion3 front end's objects hold its engine); ``rest``, the state of the embedding
    and the norms; ``not_state``, the weights and gradients it was handed (left out)."""

    holders: list[Any]
    rest: list[Any]
    not_state: list[torch.Tensor] = field(default_factory=list)


def _backward(model: torch.nn.Module, s: Shapes) -> None:
    model(tokens(s)).backward()


def torch_dion3(**options: Any) -> Callable[[torch.nn.Module, Shapes], Stepped]:
    """The torch ``Dion3``: the hidden matrices Dion3, the rest AdamW, one optimizer."""

    def run(model: torch.nn.Module, s: Shapes) -> Stepped:
        matrices, rest = split(model)
        opt = Dion3([{"params": matrices}, {"params": rest, "algorithm": "adamw"}], **options)
        _backward(model, s)
        opt.step()
        opt.zero_grad()
        return Stepped([opt], [opt.state[p] for _, p in rest])

    return run


def adamw(model: torch.nn.Module, s: Shapes) -> Stepped:
    """torch's AdamW (foreach) on every parameter: fp32 moments."""
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    _backward(model, s)
    opt.step()
    opt.zero_grad()
    return Stepped([opt], [opt.state[p] for _, p in split(model)[1]])


def adamw_bf16_moments(model: torch.nn.Module, s: Shapes) -> Stepped:
    """torchtitan's optimizer container with ``implementation="fused_opt_states_bf16"``: the state
    its step pre-hook makes (bf16 moments) before the fused step, which needs CUDA, would run."""
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    config = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="fused_opt_states_bf16",
    )
    (opt,) = OptimizersContainer(config, model_parts=[model]).optimizers
    _backward(model, s)
    for hook in opt._optimizer_step_pre_hooks.values():
        hook(opt, (), {})
    opt.zero_grad()
    return Stepped([opt], [opt.state[p] for _, p in split(model)[1]])


def muon(model: torch.nn.Module, s: Shapes) -> Stepped:
    """``torch.optim.Muon`` on the hidden matrices (one fp32 momentum), torch's AdamW on the rest."""
    matrices, rest = split(model)
    opts = [torch.optim.Muon([p for _, p in matrices]), torch.optim.AdamW([p for _, p in rest], foreach=True)]
    _backward(model, s)
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return Stepped(opts, [opts[1].state])


_deepspeed: Any = None


def _start_deepspeed() -> Any:
    """DeepSpeed on the CPU accelerator over gloo, world size 1, Dion3 registered (once)."""
    global _deepspeed
    if _deepspeed is None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        import deepspeed

        # Starting comms would compile a C++ shared-memory op, which gloo does not use.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        import dion3_megatron.deepspeed  # noqa: F401 (registers "type": "Dion3")

        deepspeed.init_distributed(dist_backend="gloo")
        _deepspeed = deepspeed
    return _deepspeed


def deepspeed_zero1(**options: Any) -> Callable[[torch.nn.Module, Shapes], Stepped]:
    """DeepSpeed ZeRO-1 with ``"type": "Dion3"``: the hidden matrices one param group, the rest an
    AdamW one; the optimizer ZeRO steps (``DeepSpeedZeroDion3``) and its engine are counted."""

    def run(model: torch.nn.Module, s: Shapes) -> Stepped:
        deepspeed = _start_deepspeed()
        matrices, rest = split(model)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Dion3", "params": options},
            "zero_optimization": {"stage": 1},
            "steps_per_print": 10**9,
        }
        groups = [{"params": [p for _, p in matrices]}, {"params": [p for _, p in rest], "algorithm": "adamw"}]
        engine, zero_wrapper, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        engine.backward(engine(tokens(s)))
        engine.step()  # (which frees the gradients)
        opt = zero_wrapper.optimizer
        flat = [t for ts in (zero_wrapper.single_partition_of_fp32_groups, zero_wrapper.bit16_groups_flat) for t in ts]
        rest_flat = [p for g in opt.param_groups if g.get("algorithm") == "adamw" for p in g["params"]]
        return Stepped([opt], [opt.state[p] for p in rest_flat], not_state=flat + [t.grad for t in flat if t.grad is not None])

    return run


@dataclass(frozen=True)
class Case:
    name: str  # its row in docs/memory.md
    run: Callable[[torch.nn.Module, Shapes], Stepped]


CASES = [
    Case("Dion3, f = 1/4 (torch `Dion3`)", torch_dion3(fraction=FRACTION)),
    Case("Dion3, f = 1/4, staleness 0 (torch `Dion3`)", torch_dion3(fraction=FRACTION, staleness=0.0)),
    Case("Dion3, f = 1/4, bf16 momentum (torch `Dion3`)", torch_dion3(fraction=FRACTION, momentum_dtype="bf16")),
    Case("Dion3, f = 1/4 (DeepSpeed ZeRO-1)", deepspeed_zero1(fraction=FRACTION)),
    Case("Dion3, f = 1/4, staleness 0 (DeepSpeed ZeRO-1)", deepspeed_zero1(fraction=FRACTION, staleness=0.0)),
    Case("Dion3, f = 1/4, bf16 momentum (DeepSpeed ZeRO-1)", deepspeed_zero1(fraction=FRACTION, momentum_dtype="bf16")),
    Case(
        "Dion3, f = 1/4, bf16 momentum, staleness 0 (DeepSpeed ZeRO-1)",
        deepspeed_zero1(fraction=FRACTION, momentum_dtype="bf16", staleness=0.0),
    ),
    Case("AdamW, fp32 moments (torch `AdamW`)", adamw),
    Case("AdamW, bf16 moments (torchtitan `fused_opt_states_bf16`)", adamw_bf16_moments),
    Case("Muon, fp32 momentum (`torch.optim.Muon`)", muon),
]


# ------------------------------------------------------------------------------------------------
# Counting: every tensor reachable from the holders through containers and the package's own
# objects, each distinct storage once.


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(where its storage starts, its bytes)."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def storages(roots: Iterable[Any], excluded: set[int]) -> dict[int, int]:
    """The distinct storages of the tensors reachable from ``roots`` (start -> bytes), those starting
    at ``excluded`` left out. Descends into dicts, lists, tuples and sets, the roots' attributes,
    and the attributes of objects of this package (a Dion3 front end's session, engine, exchanges)."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    stack = [(obj, True) for obj in roots]
    while stack:
        obj, is_root = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                start, size = _storage(obj)
                if size and start not in excluded:
                    found[start] = size
        elif isinstance(obj, dict):
            stack.extend((v, False) for v in obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((v, False) for v in obj)
        elif is_root or type(obj).__module__.startswith("dion3_megatron"):
            attributes = getattr(obj, "__dict__", {}) or {s: getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())}
            stack.extend((v, False) for v in attributes.values())
    return found


def measure(case: Case, s: Shapes) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Model(s)
    stepped = case.run(model, s)
    matrices, rest = split(model)
    weights = [p for _, p in model.named_parameters()]
    excluded = {_storage(t)[0] for t in [*weights, *(p.grad for p in weights if p.grad is not None), *stepped.not_state]}
    for holder in stepped.holders:
        for group in getattr(holder, "param_groups", []):
            excluded |= {_storage(t)[0] for p in group["params"] for t in (p, p.grad) if t is not None}
    held = storages(stepped.holders, excluded)
    in_state = storages([h.state for h in stepped.holders], excluded)
    for_rest = storages(stepped.rest, excluded)
    assert set(for_rest) <= set(held) and set(in_state) <= set(held)
    model_params = sum(p.numel() for p in weights)
    matrix_params = sum(p.numel() for _, p in matrices)
    total, rest_bytes = sum(held.values()), sum(for_rest.values())
    return {
        "name": case.name,
        "bytes": total,
        "state dict bytes": sum(in_state.values()),
        "other buffers bytes": total - sum(in_state.values()),
        "bytes per parameter": total / model_params,
        "bytes per matrix parameter": (total - rest_bytes) / matrix_params,
        "rest bytes per parameter": rest_bytes / (model_params - matrix_params),
    }


# ------------------------------------------------------------------------------------------------
# The page's table, from the results.

TABLE_START = "<!-- the table: benchmarks/bench_memory.py --page writes it from benchmarks/results/memory-cpu.json -->"
TABLE_END = "<!-- end of the table -->"


def table(report: dict) -> str:
    """docs/memory.md's table: a row per case, in the order measured."""
    lines = [
        "| optimizer (front end) | bytes per parameter of the model | bytes per parameter of the hidden matrices | MiB |",
        "|---|---|---|---|",
    ]
    for case in report["cases"]:
        per_parameter, per_matrix_parameter = case["bytes per parameter"], case["bytes per matrix parameter"]
        lines.append(f"| {case['name']} | {per_parameter:.3f} | {per_matrix_parameter:.3f} | {case['bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def write_table(page: Path, report: dict) -> None:
    text = page.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(TABLE_START) + r"\n.*?\n" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{page}: no table between {TABLE_START!r} and {TABLE_END!r}")
    # (blank lines around it: an HTML comment starts a block that runs to the next blank line)
    page.write_text(pattern.sub(lambda _: f"{TABLE_START}\n\n{table(report)}\n\n{TABLE_END}", text), encoding="utf-8")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "torchtitan"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results there")
    parser.add_argument("--page", type=Path, help="write the table into this page (docs/memory.md), between its markers")
    parser.add_argument("--cases", nargs="+", help="only the cases whose name contains one of these")
    args = parser.parse_args()
    s = Shapes()
    cases = [c for c in CASES if not args.cases or any(word in c.name for word in args.cases)]
    results = []
    for case in cases:
        results.append(measure(case, s))
        r = results[-1]
        print(f"{case.name:<62} {r['bytes per parameter']:6.2f} B/param  {r['bytes per matrix parameter']:6.2f} B/matrix param", flush=True)
    model = Model(s)
    report = {
        "what": "bytes of every distinct storage an optimizer holds after a step and zero_grad() (its state and its engine's "
        "buffers; not the weights and the gradients it was handed), per parameter of the model and of its hidden matrices",
        "command": "python benchmarks/bench_memory.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "versions": versions(),
        "model": {
            "shapes": dataclasses.asdict(s),
            "parameters": sum(p.numel() for p in model.parameters()),
            "hidden matrix parameters": sum(p.numel() for _, p in split(model)[0]),
        },
        "fraction": FRACTION,
        "cases": results,
    }
    print(table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.page is not None:
        write_table(args.page, report)


if __name__ == "__main__":
    main()
