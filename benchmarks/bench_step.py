"""Full optimizer step on one GPU: Dion3 (f = 1, 1/4, 1/8, "auto") vs a Muon step, 8 layers of 14B shapes.

Per layer (14B with grouped-query attention): Q and O 5120x5120, K and V 1024x5120, SwiGLU gate
and up 13824x5120, down 5120x13824. ``--model 350m``: the matrices the Megatron adapter makes of
docs/megatron.md's 350M model (width 1024, ffn 2816, 4 query groups; use ``--layers 24``).
Muon: heavy-ball momentum and Keller-quintic NS5 in bf16 on each matrix, one at a time, as Muon
ships. Dion3: the torch optimizer (same-shape blocks batched, Gram NS with the kernels where they
pay). Median of CUDA-event timings, every optimizer's timed steps interleaved with the others';
ratios from one run. It prints the run's estimated memory (step_memory.py) and its peak, and
writes both to its JSON.

  python benchmarks/bench_step.py [--model 14b|350m] [--layers N] [--json out.json]
  python benchmarks/bench_step.py --profile 0.25     # where one eager Dion3 step's GPU time goes
  python benchmarks/bench_step.py --kernel-config tile=128x256   # Dion3 under a kernel setting
"""

from __future__ import annotations

import argparse
import json

import torch
import step_memory
from kernel_settings import add_kernel_config_option
from timing import cuda_median_ms_interleaved

from dion3_megatron import Dion3, kernels
from dion3_megatron.core import ortho

LAYERS = {
    "14b": [(5120, 5120), (1024, 5120), (1024, 5120), (5120, 5120), (13824, 5120), (13824, 5120), (5120, 13824)],
    "350m": [(1024, 1024), (256, 1024), (256, 1024), (1024, 1024), (2816, 1024), (2816, 1024), (1024, 2816)],
}


class Muon:
    def __init__(self, params, lr=0.02, mu=0.95):
        self.params, self.lr, self.mu = params, lr, mu
        self.momenta = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.momenta):
            m.mul_(self.mu).add_(p.grad)
            update = ortho.newton_schulz(m, ortho.keller_coefficients(), dtype=torch.bfloat16, norm_factor=1.0)
            p.add_(update.to(p.dtype), alpha=-self.lr * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)


def profile(params, fraction: float, rows: int = 25) -> None:
    """GPU time of one eager Dion3 step (no CUDA graph, so every kernel is listed), by kernel."""
    opt = Dion3(params, fraction=fraction, cuda_graph=False)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        opt.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 1e3
    print(f"one eager Dion3 step, f = {fraction}: {total:.1f} ms of GPU kernels")
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))
    print("by torch operator and input shapes (GPU time of the kernels each one launched):")
    print(
        prof.key_averages(group_by_input_shape=True).table(
            sort_by="device_time_total", row_limit=2 * rows, max_name_column_width=40, max_shapes_column_width=70
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(LAYERS), default="14b", help="whose layer shapes")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of matrices (default: 8 where their estimated memory fits the GPU, e.g. an H200; else 4, 2 or 1)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--profile", type=float, default=None, metavar="FRACTION", help="only profile one eager Dion3 step at this fraction"
    )
    add_kernel_config_option(parser, "the Dion3 steps")
    args = parser.parse_args()
    settings = dict(args.kernel_config)
    kernels.configure(**settings)  # Dion3's steps; Muon below runs on plain torch whatever is set
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    if args.layers is None:
        args.layers = step_memory.default_layers(LAYERS[args.model], gpu_bytes)
    estimate = step_memory.bench_step_bytes(LAYERS[args.model], args.layers)
    print(
        f"{args.layers} layers of {args.model} shapes: estimated {estimate['total'] / step_memory.GIB:.1f} GiB "
        f"of the GPU's {gpu_bytes / step_memory.GIB:.1f} GiB"
        + (
            f" (8 layers: {step_memory.bench_step_bytes(LAYERS[args.model], 8)['total'] / step_memory.GIB:.1f} GiB)"
            if args.layers < 8
            else ""
        ),
        flush=True,
    )
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for _ in range(args.layers):
        for shape in LAYERS[args.model]:
            p = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=gen) * 0.02)
            p.grad = torch.randn(shape, device="cuda", generator=gen)
            params.append(p)
    if args.profile is not None:
        profile(params, args.profile)
        return
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "layers": args.layers,
        "kernel_config": {k: str(v) for k, v in settings.items()},
    }
    fractions = (1.0, 0.25, 0.125, "auto")
    optimizers = {fraction: Dion3(params, fraction=fraction) for fraction in fractions}
    muon = Muon(params)

    def muon_step(i: int) -> None:  # Muon as it ships: plain torch matmuls, whatever kernel config is set
        with kernels.using(kernels="torch"):
            muon.step()

    steps = {"muon_ms": muon_step}
    steps.update({f"dion3_{fraction}": lambda i, opt=opt: opt.step() for fraction, opt in optimizers.items()})
    results.update(cuda_median_ms_interleaved(steps, reps=10, warmup=3))
    results["memory_gib"] = {
        "gpu": round(gpu_bytes / step_memory.GIB, 2),
        "estimated": {part: round(b / step_memory.GIB, 2) for part, b in estimate.items()},
        "peak_allocated": round(torch.cuda.max_memory_allocated() / step_memory.GIB, 2),
        "peak_reserved": round(torch.cuda.max_memory_reserved() / step_memory.GIB, 2),
    }
    print(
        f"{results['device']}, torch {results['torch']}: {args.layers} layers of {args.model} shapes "
        f"({sum(p.numel() for p in params) / 1e9:.2f}B params); kernel config {kernels.current()}"
    )
    print(f"{'optimizer':<16}{'step ms':>10}{'vs muon':>9}")
    print(f"{'muon':<16}{results['muon_ms']:>10.2f}{1.0:>9.2f}")
    for fraction in fractions:
        step_ms = results[f"dion3_{fraction}"]
        print(f"{'dion3 f=' + str(fraction):<16}{step_ms:>10.2f}{results['muon_ms'] / step_ms:>9.2f}")
    fractions_chosen = optimizers["auto"].fractions
    chosen = {f"{p.shape[0]}x{p.shape[1]}": fractions_chosen[p] for p in params if p in fractions_chosen}
    results["auto_fractions"] = chosen
    print("auto chose " + ", ".join(f"{shape}: {f}" for shape, f in chosen.items()))
    memory = results["memory_gib"]
    print(
        f"memory: peak {memory['peak_allocated']:.1f} GiB allocated, {memory['peak_reserved']:.1f} GiB reserved; "
        f"estimated {memory['estimated']['total']:.1f} GiB"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
