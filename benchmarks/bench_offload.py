"""Dion3 with its state offloaded to host memory against Dion3 on the GPU, on one GPU, 8 layers of 14B shapes.

The same parameters and gradients (on the GPU) are stepped by the torch Dion3 twice: with its state
on the GPU (the step replayed as one CUDA graph, the default), and with ``offload=True`` (the state
in pinned host memory, streamed to the GPU one shape group at a time, eagerly). For each: the
median step time (CUDA events, the two interleaved), the GPU memory the optimizer holds between
steps and its peak during a step (over the parameters and gradients), and the host link's measured
bandwidth with what moving the state both ways costs at it.

AdamW stepped in host memory, the lever Adam users pull: the gradients copied to pinned host memory,
AdamW on fp32 copies of the parameters there, the parameters copied back; by torch's fused AdamW, as
Megatron's HybridDeviceOptimizer steps it (``--cpu-adamw``), or by DeepSpeed's CPU Adam, as
ZeRO-Offload steps it (``--deepspeed-cpu-adam``: a C++ extension DeepSpeed builds on first use,
which needs a C++ compiler and ninja; the build is not timed).

  python benchmarks/bench_offload.py [--layers 8] [--fraction 0.25] [--cpu-adamw] [--deepspeed-cpu-adam] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from typing import Callable

import torch
from timing import cuda_median_ms_interleaved, rounded

from dion3_megatron import Dion3, report

LAYER = [(5120, 5120), (1024, 5120), (1024, 5120), (5120, 5120), (13824, 5120), (13824, 5120), (5120, 13824)]
GIB = 2**30


def link_gib_per_s(gib: float = 1.0) -> dict[str, float]:
    """Pinned host <-> GPU bandwidth, each way, by timing one copy of ``gib`` GiB (after a warm-up)."""
    host = torch.empty(int(gib * GIB), dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    out = {}
    for name, copy in (
        ("to_gpu", lambda: device.copy_(host, non_blocking=True)),
        ("to_host", lambda: host.copy_(device, non_blocking=True)),
    ):
        copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        out[name] = gib / (time.perf_counter() - start)
    return out


def memory(opt: torch.optim.Optimizer) -> dict[str, float]:
    """GiB the optimizer holds on the GPU between steps (after 3) and at most during a step, over
    what was allocated before it existed (the parameters and gradients)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    between = torch.cuda.memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    return {"between_steps_gib": between / GIB, "peak_during_step_gib": (torch.cuda.max_memory_allocated() - before) / GIB}


def torch_fused_adamw(host: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(host, lr=1e-4, fused=True)


def deepspeed_cpu_adam(host: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(host, lr=1e-4, adamw_mode=True)


class HostAdamW:
    """AdamW offloaded: gradients to pinned host memory, ``build``'s AdamW on fp32 host copies of
    the parameters, parameters back."""

    def __init__(self, params: list[torch.nn.Parameter], build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.params = params
        self.host = [torch.nn.Parameter(p.detach().cpu().pin_memory()) for p in params]
        for h in self.host:
            h.grad = torch.empty_like(h).pin_memory()
        self.adamw = build(self.host)

    @torch.no_grad()
    def step(self) -> None:
        for p, h in zip(self.params, self.host):
            assert h.grad is not None and p.grad is not None
            h.grad.copy_(p.grad, non_blocking=True)
        torch.cuda.synchronize()
        self.adamw.step()
        for p, h in zip(self.params, self.host):
            p.copy_(h, non_blocking=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--cpu-adamw", action="store_true", help="also time AdamW offloaded as Megatron's HybridDeviceOptimizer steps it")
    parser.add_argument("--deepspeed-cpu-adam", action="store_true", help="also time AdamW offloaded as ZeRO-Offload steps it")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for _ in range(args.layers):
        for shape in LAYER:
            p = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=gen) * 0.02)
            p.grad = torch.randn(shape, device="cuda", generator=gen)
            params.append(p)
    count = sum(p.numel() for p in params)
    results: dict = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda},
        "kernels": {line.label: line.value for line in report.kernels()},
        "layers": args.layers,
        "parameters": count,
        "fraction": args.fraction,
        "state_gib": count * 4 / GIB,  # the momentum (fp32); the row variances and ages add one value per row
        "link_gib_per_s": link_gib_per_s(),
    }
    link = results["link_gib_per_s"]
    results["state_round_trip_ms_at_link"] = 1e3 * results["state_gib"] * (1 / link["to_gpu"] + 1 / link["to_host"])

    results["memory"] = {}
    for name, offload in (("on_gpu", False), ("offloaded", True)):
        opt = Dion3(params, fraction=args.fraction, offload=offload)
        results["memory"][name] = memory(opt)
        del opt
        gc.collect()
        torch.cuda.empty_cache()

    optimizers: dict[str, Callable[[int], object]] = {}
    on_gpu, offloaded = Dion3(params, fraction=args.fraction), Dion3(params, fraction=args.fraction, offload=True)
    optimizers["dion3_on_gpu_ms"] = lambda i: on_gpu.step()
    optimizers["dion3_offloaded_ms"] = lambda i: offloaded.step()
    host_steppers = {
        "adamw_offloaded_ms": (args.cpu_adamw, torch_fused_adamw),
        "deepspeed_cpu_adam_ms": (args.deepspeed_cpu_adam, deepspeed_cpu_adam),
    }
    for key, (wanted, build) in host_steppers.items():
        if wanted:
            optimizers[key] = lambda i, host=HostAdamW(params, build): host.step()
    results.update(cuda_median_ms_interleaved(optimizers, reps=args.reps, warmup=3))
    results["offloaded_vs_on_gpu"] = results["dion3_offloaded_ms"] / results["dion3_on_gpu_ms"]

    shapes = f"{args.layers} layers of 14B shapes ({count / 1e9:.2f}B parameters)"
    print(f"{results['gpu']}, torch {torch.__version__}: {shapes}, f = {args.fraction}")
    print(f"host link: {link['to_gpu']:.1f} GiB/s to the GPU, {link['to_host']:.1f} GiB/s back")
    print(f"state {results['state_gib']:.2f} GiB: its round trip at that bandwidth {results['state_round_trip_ms_at_link']:.1f} ms")
    for name in optimizers:
        print(f"{name[:-3]:<22}{results[name]:>10.2f} ms")
    for name, held in results["memory"].items():
        print(
            f"GPU memory, Dion3 {name}: {held['between_steps_gib']:.2f} GiB between steps, {held['peak_during_step_gib']:.2f} GiB at peak"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounded(results), f, indent=1)


if __name__ == "__main__":
    main()
