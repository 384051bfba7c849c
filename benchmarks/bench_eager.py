"""What a step outside a CUDA graph pays on the host: our launches against cuBLAS's and quack's.

    python benchmarks/bench_eager.py

Three tables, each measured side by side in one run (timed runs interleaved, timing.py):
  1. host time per product: the matmul backends' products (ours forced onto the kernel, torch's
     cuBLAS, quack's gemm_symmetric) on a 128x128 operand, back to back, eager: each call's time
     is its host time, the GPU's share being a few microseconds;
  2. the normalization of Newton-Schulz's input, the Triton kernels against the torch form, eager
     and replayed from a CUDA graph;
  3. products near the routing's thresholds, eager, back to back (each call's time is the larger of
     its host and GPU time): ours on the kernel against cuBLAS, and whether the measured routing
     sends the product to the kernel.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from timing import cuda_median_ms_interleaved, graph_replays

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quack_backend  # noqa: E402 - imports the package

from dion3_megatron import kernels  # noqa: E402
from dion3_megatron.core import ortho
from dion3_megatron.kernels.dispatch import TORCH_BACKEND  # noqa: E402
from dion3_megatron.kernels.symm import backend, heuristics  # noqa: E402

NORMALIZED = [(1, 1024, 5120), (1, 2048, 8192), (8, 1024, 4096), (1, 5120, 5120), (16, 1024, 5120), (1, 4096, 16384), (1, 5120, 13824)]
BOUNDARY = [
    ("gram", 1, 2048, 2048),
    ("gram", 1, 2048, 4096),
    ("gram", 1, 2048, 8192),
    ("gram", 1, 3072, 3072),
    ("gram", 4, 1024, 5120),
    ("gram", 8, 1024, 5120),
    ("symm", 1, 2048, 2048),
    ("symm", 2, 2048, 2048),
    ("symm", 8, 1024, 1024),
    ("symm", 16, 1024, 1024),
    ("symm", 1, 3072, 3072),
    ("symm", 1, 4096, 4096),
]


def host_us_per_call(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def host_cost() -> None:
    r = torch.randn(1, 128, 128, device="cuda", dtype=torch.float16)
    r = (r + r.mT) / 32
    x = torch.randn(1, 128, 256, device="cuda", dtype=torch.float16)
    backends = {"ours": backend.KERNEL_BACKEND, "torch (cuBLAS)": TORCH_BACKEND}
    gemm_symmetric = quack_backend.quack_gemm_symmetric()
    if gemm_symmetric is not None:
        backends["quack"] = quack_backend.make_backend(gemm_symmetric)
    print("\n## Host time per product, eager (128x128 result)\n\n| backend | X X^T us | P Q + C us |\n|---|---|---|")
    with kernels.using(routing="always"), kernels.pinned():
        for name, be in backends.items():
            gram = host_us_per_call(lambda: be.gram(x, 1.0, 0.0, None))
            symm = host_us_per_call(lambda: be.symmetric(r, r, 0.5, -1.0, r))
            print(f"| {name} | {gram:.1f} | {symm:.1f} |", flush=True)


def normalization() -> None:
    def form(fused_rows: bool):
        def run(x):
            with kernels.using(fused_rows=fused_rows):
                return ortho._normalized(x, torch.float16, 1.0, 1e-7)

        return run

    print(
        "\n## Normalizing Newton-Schulz's input (us)\n\n| input | Triton eager | torch eager | Triton graph | "
        "torch graph | eager: Triton vs torch |\n|---|---|---|---|---|---|"
    )
    for b, r, c in NORMALIZED:
        xs = [torch.randn(b, r, c, device="cuda") for _ in range(2)]
        fns = {}
        for name, fn in (("Triton", form(True)), ("torch", form(False))):
            call = lambda i, fn=fn: fn(xs[i])  # noqa: E731
            fns[f"{name} eager"] = call
            fns[f"{name} graph"] = graph_replays(call, 2)
        us = {k: v * 1e3 for k, v in cuda_median_ms_interleaved(fns, 2, 10, reps=7, warmup=3).items()}
        print(
            f"| {b}x{r}x{c} | {us['Triton eager']:.1f} | {us['torch eager']:.1f} | {us['Triton graph']:.1f} | "
            f"{us['torch graph']:.1f} | {us['torch eager'] / us['Triton eager']:.2f}x |",
            flush=True,
        )


def boundary() -> None:
    print(
        "\n## Products near the routing's thresholds, eager (us per call)\n\n| product | kernel | cuBLAS | "
        "kernel vs cuBLAS | routed to the kernel |\n|---|---|---|---|---|"
    )
    for kind, b, m, k in BOUNDARY:
        if kind == "gram":
            xs = [torch.randn(b, m, k, device="cuda", dtype=torch.float16) for _ in range(4)]

            def run(be, i):
                return be.gram(xs[i], 1.0, 0.0, None)
        else:
            k = m
            xs = [(s + s.mT).half() for s in (torch.randn(b, m, m, device="cuda") / m**0.5 for _ in range(4))]

            def run(be, i):
                return be.symmetric(xs[i], xs[i], 1.5, -0.5, xs[i])

        with kernels.using(routing="always"), kernels.pinned():
            ms = cuda_median_ms_interleaved(
                {"kernel": lambda i: run(backend.KERNEL_BACKEND, i), "cuBLAS": lambda i: run(TORCH_BACKEND, i)}, 4, 20, reps=7, warmup=3
            )
        routed = heuristics.routes_to_kernel(b, m, k, torch.float16, kernels.current())
        print(
            f"| {kind} {b}x{m}x{k} | {ms['kernel'] * 1e3:.1f} | {ms['cuBLAS'] * 1e3:.1f} | {ms['cuBLAS'] / ms['kernel']:.2f}x | {routed} |",
            flush=True,
        )


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"GPU {props.name}; torch {torch.__version__}")
    host_cost()
    normalization()
    boundary()


if __name__ == "__main__":
    main()
