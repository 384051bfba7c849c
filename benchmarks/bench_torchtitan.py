"""torchtitan's own trainer with Dion3 and with its default AdamW, side by side: loss and throughput.

    python benchmarks/bench_torchtitan.py --steps 100 --out benchmarks/results/torchtitan-debugmodel.json

Runs ``torchrun -m torchtitan.train`` twice from ``--workdir`` (a torchtitan checkout, or any
folder with torchtitan's ``tests/assets/tokenizer``): ``--module dion3_megatron.torchtitan --config
llama3_debugmodel_dion3`` (Dion3 on the hidden matrices, AdamW on the rest) and ``--module llama3
--config llama3_debugmodel`` (AdamW everywhere, torchtitan's default), each with the same overrides.
``--stdlib-corpus`` trains both on the running Python's standard-library sources written as a
``c4_test``-style JSON-lines file (for a machine without torchtitan's test data). Reads each run's
log: the loss and tokens per second per GPU at every step; prints and writes medians over the steps
after ``--warmup`` and their ratio, with the GPU and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
RUNS = {
    "dion3": ["--module", "dion3_megatron.torchtitan", "--config", "llama3_debugmodel_dion3"],
    "adamw": ["--module", "llama3", "--config", "llama3_debugmodel"],
}
# A training step's line (torchtitan's MetricsProcessor.log); validation lines ("validate step: ...")
# are left out.
STEP_LINE = re.compile(r"(?<!validate )step:\s*(\d+)\s+loss:\s*([0-9.]+).*?tps:\s*([0-9,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="training steps of each run (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the medians (default 10)")
    p.add_argument("--gpus", type=int, default=1, help="processes per run, one per GPU (default 1)")
    p.add_argument("--workdir", default=".", help="folder torchtitan runs from (default: here)")
    p.add_argument("--stdlib-corpus", action="store_true", help="train on the standard library's sources")
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("overrides", nargs="*", help="torchtitan overrides given to both runs (after --)")
    return p.parse_args(argv)


def steps_of(log: str) -> dict[int, tuple[float, float]]:
    """{step: (loss, tokens per second)} from a torchtitan log."""
    found = {}
    for line in ANSI.sub("", log).splitlines():
        m = STEP_LINE.search(line)
        if m:
            found[int(m.group(1))] = (float(m.group(2)), float(m.group(3).replace(",", "")))
    return found


def train(name: str, args: argparse.Namespace, extra: list[str]) -> dict:
    command = [
        "--standalone", f"--nproc-per-node={args.gpus}", "-m", "torchtitan.train",
        *RUNS[name], f"--training.steps={args.steps}", *extra, *args.overrides,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    done = subprocess.run(torchrun + command, cwd=args.workdir, env=env, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        sys.exit(f"{name}: torchtitan exited {done.returncode}\n{log[-4000:]}")
    steps = steps_of(log)
    if len(steps) < args.steps:
        sys.exit(f"{name}: the log shows {len(steps)} of {args.steps} steps\n{log[-4000:]}")
    timed = [tps for step, (_, tps) in steps.items() if step > args.warmup]
    last = sorted(steps)[-10:]
    return {
        "command": " ".join(["torchrun", *command]),
        "loss": {str(s): steps[s][0] for s in sorted(steps)},
        "loss_mean_last_10": statistics.fmean(steps[s][0] for s in last),
        "tokens_per_second_median": statistics.median(timed),
    }


def environment() -> dict:
    import torch
    import torchtitan

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "unknown"),
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> None:
    from examples.stdlib_text import write_stdlib_corpus

    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if args.stdlib_corpus:
            extra.append(f"--dataloader.dataset_path={write_stdlib_corpus(Path(tmp) / 'c4_test')}")
        runs = {name: train(name, args, extra) for name in RUNS}
    ratio = runs["dion3"]["tokens_per_second_median"] / runs["adamw"]["tokens_per_second_median"]
    for name, run in runs.items():
        print(f"{name}: loss (mean of the last 10 steps) {run['loss_mean_last_10']:.4f}, "
              f"{run['tokens_per_second_median']:,.0f} tokens/s per GPU (median after step {args.warmup})")  # fmt: skip
    print(f"dion3 / adamw throughput: {ratio:.3f}")
    result = {
        "what": "torchtitan's trainer (torchrun -m torchtitan.train), llama3 debug model, Dion3 config against "
        "torchtitan's default AdamW config with the same overrides",
        **environment(),
        "data": "the standard library's sources (c4_test format)" if args.stdlib_corpus else "torchtitan's c4_test",
        "dion3_over_adamw_throughput": ratio,
        "runs": runs,
        "benchmark": "python benchmarks/bench_torchtitan.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
