"""Host cost of the optimizer step per matrix: Dion3 against torch's AdamW (foreach), side by side.

Many small matrices on one CPU thread, so that the step's cost is its per-matrix host path (the
Python, the dispatch of each kernel) rather than arithmetic: ``--matrices`` counts (default 30,
300 and 3,000) of three small shapes in turn (16 x 16, 32 x 16, 16 x 64), each with a gradient.
The same parameters, copied, step under torch ``AdamW(foreach=True)`` and under ``Dion3`` (f = 1/4,
its other defaults); the two alternate step by step (so a drift of the machine reaches both), and
each step's CPU time of this process is measured. Reported per count: the median over ``--steps``
steps of each, per matrix, and their ratio (Dion3 / AdamW).

  python benchmarks/host_cost.py [--matrices 30 300 3000] [--steps 30] [--json benchmarks/results/host-cost-cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dion3_megatron import Dion3  # noqa: E402

SHAPES = ((16, 16), (32, 16), (16, 64))
FRACTION = 0.25
WARMUP = 3


def _parameters(count: int) -> list[torch.nn.Parameter]:
    """``count`` matrices of :data:`SHAPES` in turn, each with a gradient (drawn fresh, seeded)."""
    generator = torch.Generator().manual_seed(count)
    params = []
    for i in range(count):
        p = torch.nn.Parameter(torch.randn(SHAPES[i % len(SHAPES)], generator=generator))
        p.grad = 1e-2 * torch.randn(p.shape, generator=generator)
        params.append(p)
    return params


def _copies(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    copies = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        copies.append(q)
    return copies


def measure(count: int, steps: int) -> dict[str, float]:
    """Median CPU microseconds per matrix of one step of each optimizer, and their ratio."""
    params = _parameters(count)
    optimizers = {
        "adamw": torch.optim.AdamW(_copies(params), foreach=True),
        "dion3": Dion3(_copies(params), fraction=FRACTION),
    }
    for opt in optimizers.values():
        for _ in range(WARMUP):
            opt.step()
    seconds: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(steps):
        for name, opt in optimizers.items():
            start = time.process_time()
            opt.step()
            seconds[name].append(time.process_time() - start)
    per_matrix = {name: statistics.median(s) / count * 1e6 for name, s in seconds.items()}
    return {
        "adamw us per matrix": per_matrix["adamw"],
        "dion3 us per matrix": per_matrix["dion3"],
        "dion3 / adamw": per_matrix["dion3"] / per_matrix["adamw"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrices", type=int, nargs="+", default=[30, 300, 3000])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the results there")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    results = {}
    for count in args.matrices:
        results[str(count)] = measure(count, args.steps)
        r = results[str(count)]
        print(
            f"{count:6d} matrices: AdamW {r['adamw us per matrix']:6.1f} us, Dion3 {r['dion3 us per matrix']:6.1f} us "
            f"per matrix per step: {r['dion3 / adamw']:.2f}x AdamW's"
        )
    if args.json is not None:
        report = {
            "what": f"CPU time of one optimizer step per matrix (median of {args.steps} steps, the two alternating), "
            f"{'/'.join(f'{n}x{m}' for n, m in SHAPES)} matrices in turn, one thread, Dion3 at f = {FRACTION:g} "
            "against torch.optim.AdamW(foreach=True)",
            "command": "python benchmarks/host_cost.py " + " ".join(sys.argv[1:]),
            "date": datetime.date.today().isoformat(),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "load average before the run": load},
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
            "measurements": results,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
