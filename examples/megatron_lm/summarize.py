"""The logs of compare_on_gpus.sh as one table: Megatron's ``optimizer`` timer and the loss per run.

    python examples/megatron_lm/summarize.py runs/megatron_lm/*.log

Reads what Megatron-LM prints with ``--log-interval N --timing-log-level 1``: the iteration lines
(lm loss, elapsed time per iteration) and, after each, the timers averaged over the interval
(the ``optimizer`` row's max across ranks). The means leave out the first two logs (iteration 1
and the first interval: compilation, warm-up, CUDA-graph capture). A run ``X_resumed.log`` next to
``X.log`` is the same run resumed from a checkpoint: the first iteration it logs must show the loss
the uninterrupted run logged there. Resumed at another
tensor-parallel size (Megatron's argument dump says which) the sums run in another order, so the
summary gives the relative difference of the two losses instead.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): (\S+) \|.*? lm loss: (\S+) \|")
OPTIMIZER_TIMER = re.compile(r"^\s+optimizer \.+: \(([\d.]+), ([\d.]+)\)")
OPTIMIZER_NAME = re.compile(r"^\s+optimizer \.+ (\w+)\s*$")
TENSOR_PARALLEL = re.compile(r"^\s+tensor_model_parallel_size \.+ (\d+)\s*$")
LAYOUT = re.compile(r"Using (reduce-scatter|all-reduce) for gradient reductions")
RESUMED = "_resumed"
WARM_UP_LOGS = 2  # logged iterations left out of the means


@dataclass
class Interval:
    iteration: int
    iteration_ms: float
    loss: str  # as Megatron prints it, so that equal losses compare equal
    optimizer_ms: float | None = None


@dataclass
class Run:
    name: str
    optimizer: str = "?"
    layout: str = "?"
    tensor_parallel: int | None = None  # from Megatron's argument dump
    intervals: list[Interval] = field(default_factory=list)

    def mean(self, attribute: str) -> float | None:
        values = [getattr(i, attribute) for i in self.intervals[WARM_UP_LOGS:] if getattr(i, attribute) is not None]
        return statistics.mean(values) if values else None


def parse(name: str, text: str) -> Run:
    run = Run(name)
    for line in text.splitlines():
        if match := ITERATION.search(line):
            run.intervals.append(Interval(int(match[1]), float(match[2]), match[3]))
        elif (match := OPTIMIZER_TIMER.match(line)) and run.intervals:
            run.intervals[-1].optimizer_ms = float(match[2])
        elif match := OPTIMIZER_NAME.match(line):
            run.optimizer = match[1]
        elif match := TENSOR_PARALLEL.match(line):
            run.tensor_parallel = int(match[1])
        elif match := LAYOUT.search(line):
            run.layout = match[1]
    return run


def table(runs: list[Run]) -> str:
    """One row per run; Dion3's and every run's optimizer time against Muon's and Adam's."""
    by_optimizer = {r.optimizer: r.mean("optimizer_ms") for r in runs if not r.name.endswith(RESUMED)}
    muon, adam = by_optimizer.get("muon"), by_optimizer.get("adam")
    rows = [("run", "optimizer", "layout", "iterations", "optimizer ms", "vs Muon", "vs Adam", "iteration ms", "last lm loss")]
    for r in runs:
        opt_ms = r.mean("optimizer_ms")
        last = r.intervals[-1] if r.intervals else None
        rows.append(
            (
                r.name,
                r.optimizer,
                r.layout,
                str(last.iteration if last else 0),
                "-" if opt_ms is None else f"{opt_ms:.2f}",
                "-" if opt_ms is None or not muon or r.optimizer == "muon" else f"{muon / opt_ms:.2f}x less",
                "-" if opt_ms is None or adam is None or r.optimizer == "adam" else f"{opt_ms - adam:+.2f} ms",
                "-" if r.mean("iteration_ms") is None else f"{r.mean('iteration_ms'):.1f}",
                last.loss if last else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def resume_verdicts(runs: list[Run]) -> list[str]:
    """For each X_resumed next to X: does its first logged iteration show X's loss there? (At
    another tensor-parallel size: how far from it, relatively.)"""
    full = {r.name: r for r in runs}
    verdicts = []
    for r in runs:
        if not r.name.endswith(RESUMED) or r.name[: -len(RESUMED)] not in full or not r.intervals:
            continue
        first = r.intervals[0]
        saved = full[r.name[: -len(RESUMED)]]
        before = {i.iteration: i.loss for i in saved.intervals}
        if first.iteration not in before:
            verdicts.append(f"{r.name}: iteration {first.iteration} was not logged by the uninterrupted run")
            continue
        said = f"{r.name}: iteration {first.iteration} lm loss {first.loss} vs {before[first.iteration]} uninterrupted"
        if r.tensor_parallel != saved.tensor_parallel:
            relative = abs(float(first.loss) / float(before[first.iteration]) - 1)
            verdicts.append(
                f"{said}, resumed at TP={r.tensor_parallel} from TP={saved.tensor_parallel}: "
                f"relative difference {relative:.1e} (another layout sums in another order)"
            )
        else:
            verdicts.append(f"{said}: {'identical' if before[first.iteration] == first.loss else 'DIFFERENT'}")
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    runs = [parse(path.stem, path.read_text(errors="replace")) for path in args.logs]
    print(table(runs))
    for verdict in resume_verdicts(runs):
        print(verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
