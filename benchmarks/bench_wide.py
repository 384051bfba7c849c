"""Optimizer step on very wide / tall matrices: time and peak extra GPU memory, Dion3 vs Muon.

For a 65536 x 8192 and an 8192 x 65536 matrix (embedding-sized), one GPU:
  - Dion3 (single-process optimizer) at fraction 1, 1/4, 1/8;
  - a Muon step (heavy-ball momentum, Keller-quintic NS5 in bf16 on the full matrix, torch).
Peak extra memory = max_memory_allocated during a step (state already created) minus the memory
allocated before it. The orthogonalized block is k x cols with k = f * rows, so Dion3's extra memory
should shrink about in proportion to f, and no Gram matrix of the long side is ever formed.

  python benchmarks/bench_wide.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import cuda_median_ms

from dion3_megatron import Dion3, kernels
from dion3_megatron.core import ortho


def muon_step(weight, grad, momentum, lr=0.02, mu=0.95):
    momentum.mul_(mu).add_(grad)
    update = ortho.newton_schulz(momentum, ortho.keller_coefficients(), dtype=torch.bfloat16, norm_factor=1.0)
    n, m = weight.shape
    weight.add_(update.to(weight.dtype), alpha=-lr * max(1.0, n / m) ** 0.5)


def measure(step, iters):
    step()  # creates state, compiles nothing, warms the allocator
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return cuda_median_ms(lambda i: step(), reps=iters, warmup=0), peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="65536x8192,8192x65536")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    print(f"{results['device']}, torch {results['torch']}")
    print(f"{'shape':<14}{'optimizer':<16}{'step ms':>10}{'vs muon':>9}{'peak extra MiB':>16}{'vs f=1':>8}")
    for text in args.shapes.split(","):
        n, m = (int(x) for x in text.split("x"))
        gen = torch.Generator(device=device).manual_seed(0)
        weight = torch.randn(n, m, device=device, generator=gen) * 0.02
        grad = torch.randn(n, m, device=device, generator=gen)
        momentum = torch.zeros_like(weight)
        with kernels.using(kernels="torch"):  # Muon as it ships: plain torch matmuls, not our kernels
            muon_ms, muon_mib = measure(lambda: muon_step(weight, grad, momentum), args.iters)
        del momentum
        rows = [("muon", muon_ms, muon_mib)]
        for fraction in (1.0, 0.25, 0.125):
            param = torch.nn.Parameter(weight.clone())
            param.grad = grad
            opt = Dion3([param], fraction=fraction)
            ms, mib = measure(opt.step, args.iters)
            rows.append((f"dion3 f={fraction}", ms, mib))
            del opt, param
            torch.cuda.empty_cache()
        full_mib = rows[1][2]
        for name, ms, mib in rows:
            print(f"{text:<14}{name:<16}{ms:>10.2f}{muon_ms / ms:>9.2f}{mib:>16.0f}{mib / full_mib:>8.2f}")
            results["rows"].append({"shape": text, "optimizer": name, "ms": ms, "peak_extra_mib": mib})
        del weight, grad
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
