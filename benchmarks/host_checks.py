"""Host time of the step's checks (every group's settings, every gradient, every DTensor parameter's
and gradient's placements and pieces), which run at every step before anything changes.

Two cases on CPU: the torch ``Dion3`` in one process on ``--matrices`` whole matrices (and a bias
each), and the FSDP2 small GPT of ``examples/fsdp2_train.py`` on 2 processes over gloo. Each steps
the same gradients again and again; the variants alternate step by step (so a drift of the machine
reaches all alike): the checks as they run, without the placement checks, without any check (the
last two patched out in this script only). Reported per variant: the median over ``--steps`` steps
of the whole ``opt.step()`` and of the checks alone (the ``check`` the step hands to its decision).

  python benchmarks/host_checks.py [--steps 50] [--matrices 60] [--json benchmarks/results/host-checks-cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the package and the examples' modules
    sys.path.insert(0, str(REPO))

from dion3_megatron import Dion3  # noqa: E402
from dion3_megatron.frontend import lifecycle, whole  # noqa: E402
from dion3_megatron.frontend.dtensor import HeldPieces  # noqa: E402
from examples.leave_process_group import leave_process_group  # noqa: E402
from timing import cpu_model  # noqa: E402

VARIANTS = ("checks", "without placement checks", "without checks")


@contextmanager
def _variant(name: str) -> Iterator[None]:
    """The step's checks as shipped, or with some patched out."""
    refusal, check_group = HeldPieces.refusal, whole.check_group
    if name != "checks":
        HeldPieces.refusal = lambda self, p, dion3: None
    if name == "without checks":
        whole.check_group = lambda *args, **kwargs: None
    try:
        yield
    finally:
        HeldPieces.refusal, whole.check_group = refusal, check_group


@contextmanager
def _checks_timed(into: list[float]) -> Iterator[None]:
    """Append the seconds each step's ``check()`` takes to ``into``."""
    gate = lifecycle.Dion3FrontEnd.gate_step

    def timed_gate(self, check: Callable, *args, **kwargs) -> bool:
        def timed() -> list[torch.Tensor]:
            start = time.perf_counter()
            grads = check()
            into.append(time.perf_counter() - start)
            return grads

        return gate(self, timed, *args, **kwargs)

    lifecycle.Dion3FrontEnd.gate_step = timed_gate
    try:
        yield
    finally:
        lifecycle.Dion3FrontEnd.gate_step = gate


def _measure(opt: torch.optim.Optimizer, variants: tuple[str, ...], steps: int, warmup: int = 5) -> dict:
    """Median ms per variant of ``opt.step()`` and of its checks, the variants alternating."""
    step_s: dict[str, list[float]] = {v: [] for v in variants}
    check_s: dict[str, list[float]] = {v: [] for v in variants}
    for i, name in enumerate(itertools.islice(itertools.cycle(variants), (warmup + steps) * len(variants))):
        checks: list[float] = []
        with _variant(name), _checks_timed(checks):
            start = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - start
        if i >= warmup * len(variants):
            step_s[name].append(elapsed)
            check_s[name].extend(checks)
    return {
        name: {"step ms": 1e3 * statistics.median(step_s[name]), "checks ms": 1e3 * statistics.median(check_s[name])} for name in variants
    }


def single_process(matrices: int, steps: int) -> dict:
    """The torch Dion3 on whole matrices of a few shapes, each with a bias (AdamW)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 64), (128, 64), (64, 256)]
    params = []
    for i in range(matrices):
        n, m = shapes[i % len(shapes)]
        params += [
            (f"layer{i}.weight", torch.nn.Parameter(torch.randn(n, m, generator=gen) / m**0.5)),
            (f"layer{i}.bias", torch.nn.Parameter(torch.zeros(n))),
        ]
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = Dion3(params, fraction=0.25, ns_dtype=torch.float32)
    return {
        "what": f"{matrices} matrices ({', '.join(f'{n}x{m}' for n, m in shapes)} in turn) and {matrices} "
        "biases, one process, 1 thread, f = 1/4",
        **_measure(opt, ("checks", "without checks"), steps),
    }


def fsdp2_rank(rank: int, world: int, steps: int) -> dict:
    """The example's model and optimizer on a 1-D mesh; one backward's gradients, stepped again and again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from examples.small_gpt import GPT

    torch.manual_seed(0)
    model = GPT(width=128, layers=2, heads=4, context=32)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    hidden = [(n, p) for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() >= 2]
    hidden_ids = {id(p) for _, p in hidden}
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in hidden_ids]
    opt = Dion3([{"params": hidden}, {"params": rest, "algorithm": "adamw", "lr": 3e-3}], fraction=0.25)
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1 + rank))
    model(tokens).backward()
    return {
        "what": f"examples/fsdp2_train.py's GPT (width 128, 2 layers: {len(hidden)} DTensor matrices for "
        f"Dion3, {len(rest)} DTensors for AdamW), FSDP2 over {world} CPU processes (gloo, 1 thread "
        "each), f = 1/4; rank 0's times",
        **_measure(opt, VARIANTS, steps),
    }


def _fsdp2_process(rank: int, world: int, port: int, steps: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    measured = fsdp2_rank(rank, world, steps)
    if rank == 0:
        results.put(measured)
    leave_process_group()


def fsdp2(steps: int, world: int = 2) -> dict:
    """:func:`fsdp2_rank` on ``world`` CPU processes; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_fsdp2_process, args=(rank, world, port, steps, results)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--matrices", type=int, default=60)
    parser.add_argument("--json")
    args = parser.parse_args()
    load = os.getloadavg()[0]  # other work on the machine: the step's medians move with it, the checks' less
    results = {"single process": single_process(args.matrices, args.steps), "fsdp2, 2 ranks": fsdp2(args.steps)}
    cpu = cpu_model()
    record = {
        "what": "host time of the step's checks: median ms of opt.step() and of its checks over "
        f"{args.steps} steps per variant, variants alternating",
        "command": "python benchmarks/host_checks.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "load average before the run": load},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "measurements": results,
    }
    print(json.dumps(record, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
