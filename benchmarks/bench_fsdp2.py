"""Optimizer step under FSDP2 (``fully_shard``) on GPUs: this library's Dion3 against
microsoft/dion's Dion3 (its NorDion2, default per-shard selection) and Muon, and torch's AdamW, on
the same DTensor parameters: the matrices of ``--layers`` transformer layers of bench_step.py's
shapes, each layer its own ``fully_shard`` unit over a 1-D mesh of all ranks. Gradients are drawn
once; every optimizer steps the same parameters, timed runs interleaved (median of CUDA events on
rank 0, after warm-up, which includes microsoft/dion's compilation). Ratios from one run; rank 0's
peak memory printed and written to the JSON.

``--cpu-offload-policy``: a second copy of the model under ``fully_shard(...,
offload_policy=CPUOffloadPolicy())``, its pieces, gradients and optimizer state in (page-locked) CPU
memory, stepped there by Dion3 and AdamW, and by Dion3 with ``offload=True`` (streamed through the
GPU), timed beside the same optimizers on the GPU copy.

  torchrun --standalone --nproc-per-node 1 benchmarks/bench_fsdp2.py [--model 14b|350m] [--layers 4]
      [--dion-path DIR] [--cpu-offload-policy] [--json out.json]     # DIR: a checkout of microsoft/dion
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from bench_step import LAYERS
from timing import cpu_model, cuda_median_ms_interleaved, rounded
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from dion3_megatron import Dion3, report


class _Layer(torch.nn.Module):
    """One layer's matrices (only the optimizer step is timed: no forward)."""

    def __init__(self, shapes: list[tuple[int, int]], device: torch.device) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n, m, device=device) / m**0.5) for n, m in shapes)

    def forward(self) -> None:
        raise NotImplementedError


class _Model(torch.nn.Module):
    def __init__(self, model: str, count: int, device: torch.device) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Layer(LAYERS[model], device) for _ in range(count))

    def forward(self) -> None:
        raise NotImplementedError


def _microsoft(dion_path: str, params: list, mesh, fraction: float) -> dict:
    sys.path.insert(0, dion_path)
    from dion import Muon, NorDion2  # noqa: E402 - the reader's checkout

    return {
        "microsoft/dion Dion3 f=1/4": NorDion2(params, distributed_mesh=mesh, fraction=fraction),
        "microsoft/dion Muon": Muon(params, distributed_mesh=mesh),
    }


def _sharded_params(model: str, layers: int, device: torch.device, mesh, offload_policy: CPUOffloadPolicy | None) -> list:
    """The model's DTensor parameters, each layer its own ``fully_shard`` unit, with gradients drawn
    on each rank's piece (where the piece lies: the GPU, or CPU memory under ``offload_policy``)."""
    policy = {} if offload_policy is None else {"offload_policy": offload_policy}
    sharded = _Model(model, layers, device)
    for layer in sharded.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(sharded, mesh=mesh, **policy)
    params = list(sharded.parameters())
    gen = torch.Generator(device=params[0].to_local().device).manual_seed(1)
    for p in params:  # a gradient placed like its parameter
        p.grad = p.detach().clone()
        p.grad.to_local().normal_(generator=gen)
    return params


def _cpu() -> dict:
    """The host that steps the offloaded copy: its model and the threads torch uses."""
    return {"model": cpu_model(), "torch_threads": torch.get_num_threads(), "cores": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(LAYERS), default="14b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dion-path", help="a checkout of microsoft/dion, to compare with")
    parser.add_argument("--cpu-offload-policy", action="store_true", help="also step a copy under FSDP2's CPUOffloadPolicy")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # the policy's pieces live in CPU memory, so the optimizers' collectives need a CPU backend too
    dist.init_process_group("cuda:nccl,cpu:gloo" if args.cpu_offload_policy else "nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    params = _sharded_params(args.model, args.layers, device, mesh, None)
    optimizers = {f"Dion3 f={name}": Dion3(params, fraction=f) for name, f in (("1/4", 0.25), ("1/8", 0.125))}
    if args.dion_path:
        optimizers.update(_microsoft(args.dion_path, params, mesh, 0.25))
    optimizers["AdamW (torch, foreach)"] = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if args.cpu_offload_policy:
        offloaded = _sharded_params(args.model, args.layers, device, mesh, CPUOffloadPolicy())
        optimizers["Dion3 f=1/4, CPUOffloadPolicy"] = Dion3(offloaded, fraction=0.25)
        optimizers["Dion3 f=1/4, CPUOffloadPolicy, offload=True"] = Dion3(offloaded, fraction=0.25, offload=True)
        optimizers["AdamW (torch, foreach), CPUOffloadPolicy"] = torch.optim.AdamW(offloaded, lr=1e-4, foreach=True)
    times = cuda_median_ms_interleaved({name: (lambda i, o=opt: o.step()) for name, opt in optimizers.items()}, reps=args.reps, warmup=3)
    if dist.get_rank() == 0:
        base = times.get("microsoft/dion Muon")
        print(
            f"FSDP2 over {world} GPU(s) ({torch.cuda.get_device_name()}), {args.layers} layers of {args.model} shapes, "
            f"torch {torch.__version__}; median ms per optimizer step"
        )
        for name, ms in times.items():
            print(f"{name:40s} {ms:9.2f} ms" + (f"   microsoft/dion Muon / this {base / ms:6.2f}x" if base else ""))
        memory = {
            "peak_allocated": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_reserved": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        }
        print(f"memory of rank 0: peak {memory['peak_allocated']:.1f} GiB allocated, {memory['peak_reserved']:.1f} GiB reserved")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "command": f"torchrun --standalone --nproc-per-node {world} " + " ".join(sys.argv),
                        "date": time.strftime("%Y-%m-%d"),
                        "world": world,
                        "gpu": torch.cuda.get_device_name(),
                        "torch": torch.__version__,
                        "kernels": {line.label: line.value for line in report.kernels()},
                        "model": args.model,
                        "layers": args.layers,
                        "cpu": _cpu() if args.cpu_offload_policy else None,
                        "ms": rounded(times),
                        "memory_gib": memory,
                    },
                    f,
                    indent=1,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
