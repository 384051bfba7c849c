"""Run a test function on N CPU processes over gloo and bring failures back to pytest."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # `import deepspeed` in the parent sets this, and it breaks torch.compile in later workers.
    os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    torch.set_num_threads(1)
    try:
        if "nccl" in backend:  # "nccl", or NCCL with a CPU backend beside it ("cuda:nccl,cpu:gloo")
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        results[rank] = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            try:
                dist.barrier()  # a rare gloo abort at exit otherwise
            except Exception:
                pass
            dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 300, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes (gloo; or nccl, alone or beside gloo as
    "cuda:nccl,cpu:gloo", with a GPU each).

    ``fn`` must be importable (module level). Raises AssertionError with every failing rank's
    traceback.
    """
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = {r: results[r][1] for r in range(world) if r in results and results[r][0] == "error"}
        missing = [r for r in range(world) if r not in results]
        if errors or missing:
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"distributed test failed (no result from ranks {missing})\n{report}")
        return [results[r][1] for r in range(world)]
