"""Orthogonalization of the 14B layer set: Gram NS on the kernels vs plain-torch Muon NS5.

    python benchmarks/bench_ortho.py [--iters N] [--routing measured|always]

Side by side in one run, on the same fp32 inputs:
  * muon:        Keller Jordan's quintic standard NS, 5 steps, bf16, plain torch (as Muon ships);
  * gram-torch:  dion3_megatron.ortho.gram_newton_schulz on the "torch" backend (cuBLAS);
  * gram-kern:   the same with auto dispatch (kernels where they pay, torch elsewhere), or with
                 --routing always on the "cutedsl" backend for every product the kernels take.
Square matrices take standard NS with the Polar Express schedule on either backend (the Gram
form gains nothing there). The floor is ortho.ns_flops(s, L, "gram") (symmetric products at half
cost) at the cuBLAS peak measured in this run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from timing import cuda_median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dion3_megatron import ortho  # noqa: E402
from dion3_megatron import kernels  # noqa: E402
from dion3_megatron.kernels import backend  # noqa: E402

SHAPES = [(5120, 5120), (1024, 5120), (13824, 5120), (5120, 13824)]


def muon_ns5(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    a, b, c = ortho.KELLER_QUINTIC
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * A @ A
        x = a * x + B @ x
    if tall:
        x = x.mT
    return x


def timed(fn, n_sets: int, iters: int) -> float:
    return cuda_median_ms(fn, n_sets, iters, reps=5, warmup=2)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--routing", default="measured", choices=["measured", "always"])
    args = ap.parse_args()
    n = 8192
    p = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    peak = 2 * n**3 / (timed(lambda i: p @ p, 1, 10) * 1e-3)
    props = torch.cuda.get_device_properties(0)
    print(f"GPU {props.name}; torch {torch.__version__}; cuBLAS peak {peak / 1e12:.0f} TFLOP/s (bf16 8192^3)")
    kernels.configure(routing=args.routing)
    print(f"routing: {args.routing}")
    print("| shape | muon NS5 ms | gram-torch ms | gram-kern ms | kern vs muon | kern vs gram-torch | floor ms | kern / floor |")
    print("|---|---|---|---|---|---|---|---|")
    tot = {"muon": 0.0, "gt": 0.0, "gk": 0.0, "floor": 0.0}
    for r, c in SHAPES:
        n_sets = 2
        gs = [torch.randn(r, c, device="cuda") for _ in range(n_sets)]
        t_muon = timed(lambda i: muon_ns5(gs[i]), n_sets, args.iters)
        with kernels.using(kernels="torch"):
            t_gt = timed(lambda i: ortho.gram_newton_schulz(gs[i]), n_sets, args.iters)
        # "auto": what the optimizer runs (kernels where they pay, plain torch otherwise);
        # "always" routing forces the kernel backend onto every product it can take.
        with kernels.using(backend=None if args.routing == "measured" else backend.BACKEND_NAME):
            t_gk = timed(lambda i: ortho.gram_newton_schulz(gs[i]), n_sets, args.iters)
        s, length = min(r, c), max(r, c)
        method = "standard" if r == c else "gram"
        floor = ortho.ns_flops(s, length, method) / peak * 1e3
        for key, v in (("muon", t_muon), ("gt", t_gt), ("gk", t_gk), ("floor", floor)):
            tot[key] += v
        print(
            f"| {r}x{c} | {t_muon:.3f} | {t_gt:.3f} | {t_gk:.3f} | {t_muon / t_gk:.2f}x | {t_gt / t_gk:.2f}x | "
            f"{floor:.3f} | {t_gk / floor:.2f} |",
            flush=True,
        )
    print(
        f"| total | {tot['muon']:.3f} | {tot['gt']:.3f} | {tot['gk']:.3f} | {tot['muon'] / tot['gk']:.2f}x | "
        f"{tot['gt'] / tot['gk']:.2f}x | {tot['floor']:.3f} | {tot['gk'] / tot['floor']:.2f} |"
    )


if __name__ == "__main__":
    main()
