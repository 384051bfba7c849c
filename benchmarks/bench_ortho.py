"""Orthogonalization of the 14B layer set: Gram NS on the kernels vs plain-torch Muon NS5 (and quack),
each timed eager and replayed from a CUDA graph, side by side in one run.

    python benchmarks/bench_ortho.py [--iters N] [--routing measured|always] [--modes eager,graph] [--json F]
    python benchmarks/bench_ortho.py --profile 13824x5120     # GPU time by kernel, one call each
    python benchmarks/bench_ortho.py --kernel-config tile_group=8   # under a kernel setting
    ncu --clock-control none --profile-from-start off --nvtx --csv --page details \
        python benchmarks/bench_ortho.py --profile 13824x5120 --ncu --only gram-kern,gram-quack
                                                               # hardware counters of each kernel

Side by side in one run, on the same fp32 inputs, their timed runs interleaved (timing.py):
  * muon:        Keller Jordan's quintic standard NS, 5 steps, bf16, plain torch (as Muon ships);
  * gram-torch:  dion3_megatron.core.ortho.gram_newton_schulz on the "torch" backend (cuBLAS);
  * gram-kern:   the same with auto dispatch (kernels where they pay, torch elsewhere), or with
                 --routing always on the "cutedsl" backend for every product the kernels take;
  * gram-kern-p / gram-kern-t (with --launch-variants): gram-kern with the symmetric GEMM's
                 persistent launch everywhere / one CTA per tile everywhere;
  * gram-quack:  the same Gram NS with quack-kernels' gemm_symmetric for every symmetric product
                 (benchmarks/quack_backend.py), where quack imports: the kernels compared alone.
Each variant is timed in each of --modes: "eager" (every kernel launched from Python, as a step
outside a CUDA graph runs) and "graph" (the call replayed from a CUDA graph, as inside the
optimizer's graphed step: the host's launch cost out). Square matrices take standard NS with the
Polar Express schedule on either backend (the Gram form gains nothing there). The floor is
ortho.ns_flops(s, L, "gram") (symmetric products at half cost) at the cuBLAS peak measured in this run.
The eager target: gram-kern eager at most 3% above the faster of gram-torch and gram-quack eager.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from kernel_settings import add_kernel_config_option
from timing import cuda_median_ms, cuda_median_ms_interleaved, graph_replays

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quack_backend  # noqa: E402 - imports the package

from dion3_megatron.core import ortho
from dion3_megatron import kernels  # noqa: E402
from dion3_megatron.kernels.symm import backend  # noqa: E402

# (batch, rows, cols); the last one is how the optimizer's step meets the 1024-wide K/V matrices:
# same-shape matrices of all layers in one batch (8 layers x K and V).
SHAPES = [
    (1, 13824, 5120),
    (1, 5120, 13824),
    (1, 4096, 16384),
    (1, 2048, 8192),
    (1, 5120, 5120),
    (1, 1024, 5120),
    (16, 1024, 5120),
    (8, 1024, 4096),
]
EAGER_TARGET = 1.03  # gram-kern eager within 3% of the faster of gram-torch and gram-quack eager


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


REPS = 7  # timed runs of each variant, interleaved across the variants (timing.cuda_median_ms_interleaved)


def variants(routing: str, quack: bool, launch_variants: bool) -> dict:
    """name -> orthogonalization of one fp32 matrix, each under its kernel configuration."""

    def under(**config):
        def run(g):
            with kernels.using(**config):
                return ortho.gram_newton_schulz(g)

        return run

    out = {
        "muon": muon_ns5,
        "gram-torch": under(kernels="torch"),
        # "auto": what the optimizer runs (kernels where they pay, plain torch otherwise); "always"
        # routing forces the kernel backend onto every product it can take.
        "gram-kern": under(backend=None if routing == "measured" else backend.BACKEND_NAME),
    }
    for suffix, persistent in (("p", True), ("t", False)) if launch_variants else ():
        out[f"gram-kern-{suffix}"] = under(backend=None if routing == "measured" else backend.BACKEND_NAME, persistent=persistent)
    if quack:
        out["gram-quack"] = under(backend=quack_backend.NAME)
    return out


def profile(shape: tuple[int, int], funcs: dict, rows: int = 15, ncu: bool = False) -> None:
    """GPU time by kernel of one call of each variant (eager, so every kernel is listed). With
    ``ncu`` the call runs between cudaProfilerStart and Stop, in an NVTX range named after the
    variant, for Nsight Compute (``ncu --profile-from-start off --nvtx``) in place of torch's profiler:
    the compilation and warm-up calls stay outside what it profiles."""
    g = torch.randn(*shape, device="cuda")
    for name, fn in funcs.items():
        for _ in range(3):
            fn(g)
        torch.cuda.synchronize()
        if ncu:
            torch.cuda.profiler.start()
            with torch.cuda.nvtx.range(name):
                fn(g)
                torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"{name}: one call between cudaProfilerStart and Stop, NVTX range {name!r}", flush=True)
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn(g)
            torch.cuda.synchronize()
        events = prof.key_averages()
        total = sum(e.self_device_time_total for e in events) / 1e3
        print(f"\n{name}, {'x'.join(map(str, shape))}: {total:.3f} ms of GPU kernels")
        print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))
        launches = sorted(prof.events(), key=lambda e: e.time_range.start)
        print(
            "launches in order, us: "
            + ", ".join(f"{short_kernel_name(e.name)} {e.device_time_total:.1f}" for e in launches if e.device_time_total > 0)
        )


def short_kernel_name(name: str) -> str:
    """A kernel's name cut to what tells the launches of one Gram NS apart."""
    for marker, short in (("SymmGemmSm90", "ours"), ("GemmSymmetric", "quack"), ("nvjet", "cuBLAS"), ("Memcpy", "copy")):
        if marker in name:
            return short
    return name.split("<")[0].split("(")[0].removeprefix("void ").split("::")[-1][:28]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--routing", default="measured", choices=["measured", "always"])
    ap.add_argument(
        "--modes",
        default="eager,graph",
        help="comma list of eager (launched from Python) and graph (replayed from a CUDA graph): each variant is timed in each",
    )
    ap.add_argument(
        "--launch-variants",
        action="store_true",
        help="also gram-kern-p and gram-kern-t (the persistent launch everywhere / one CTA per tile everywhere)",
    )
    ap.add_argument(
        "--shapes",
        default=None,
        metavar="RxC,...",
        help="comma list of the shapes to time (BxRxC: a batch of B) instead of the default set",
    )
    ap.add_argument("--json", default=None, metavar="FILE", help="also write every time (ms) to FILE")
    ap.add_argument("--profile", default=None, metavar="RxC", help="only the GPU time by kernel at this shape (BxRxC: a batch of B)")
    ap.add_argument(
        "--ncu",
        action="store_true",
        help="with --profile: for Nsight Compute instead of torch's "
        "profiler (one call of each variant between cudaProfilerStart and Stop; see the usage above)",
    )
    ap.add_argument("--only", default=None, metavar="NAMES", help="with --profile: comma list of the variants to profile (default: all)")
    add_kernel_config_option(ap, "every variant on our kernels")
    args = ap.parse_args()
    for flag in ("ncu", "only"):
        if getattr(args, flag) and not args.profile:
            ap.error(f"--{flag} needs --profile RxC")
    modes = args.modes.split(",")
    if not modes or set(modes) - {"eager", "graph"}:
        ap.error(f"--modes takes eager and/or graph, got {args.modes!r}")
    kernels.configure(routing=args.routing, **dict(args.kernel_config))
    funcs = variants(args.routing, quack_backend.register(), args.launch_variants)
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(funcs))
        if unknown:
            ap.error(f"--only: unknown variant(s) {unknown}; this run has {sorted(funcs)}")
        funcs = {name: funcs[name] for name in args.only.split(",")}
    if args.profile:
        profile(tuple(int(v) for v in args.profile.split("x")), funcs, ncu=args.ncu)
        return
    n = 8192
    p = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    peak = 2 * n**3 / (cuda_median_ms(lambda i: p @ p, 1, 10) * 1e-3)
    props = torch.cuda.get_device_properties(0)
    print(
        f"GPU {props.name}; torch {torch.__version__}; cuBLAS peak {peak / 1e12:.0f} TFLOP/s (bf16 8192^3); "
        f"routing {args.routing}; modes {', '.join(modes)}"
    )
    columns = [f"{name} {mode}" for mode in modes for name in funcs]
    ratios = table_ratios(list(funcs), modes)
    print(
        "| shape | " + " | ".join(f"{c} ms" for c in columns) + " | " + " | ".join(r for r, _, _ in ratios) + " | floor ms | kern / floor |"
    )
    print("|---" * (len(columns) + len(ratios) + 3) + "|")
    total = dict.fromkeys([*columns, "floor"], 0.0)
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in ("1x" + spec if spec.count("x") == 1 else spec).split("x")) for spec in args.shapes.split(",")]
    record = {
        "gpu": props.name,
        "torch": torch.__version__,
        "peak_tflops": peak / 1e12,
        "routing": args.routing,
        "command": "python benchmarks/bench_ortho.py " + " ".join(sys.argv[1:]),
        "ms": {},
    }
    kern = "gram-kern " + modes[0]
    for b, r, c in shapes:
        n_sets = 2
        gs = [torch.randn(b, r, c, device="cuda").squeeze(0) for _ in range(n_sets)]
        timed = {}
        for name, fn in funcs.items():
            call = lambda i, fn=fn: fn(gs[i])  # noqa: E731
            if "eager" in modes:
                timed[f"{name} eager"] = call
            if "graph" in modes:
                timed[f"{name} graph"] = graph_replays(call, n_sets)
        ms = cuda_median_ms_interleaved(timed, n_sets, args.iters, reps=REPS, warmup=2)
        del timed  # the graphs and their memory
        s, length = min(r, c), max(r, c)
        ms["floor"] = b * ortho.ns_flops(s, length, "standard" if r == c else "gram") / peak * 1e3
        for key, v in ms.items():
            total[key] += v
        label = f"{b}x{r}x{c}" if b > 1 else f"{r}x{c}"
        record["ms"][label] = ms
        print(row(label, ms, columns, ratios, kern), flush=True)
    print(row("total", total, columns, ratios, kern))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


def table_ratios(names: list, modes: list) -> list:
    """(label, numerator columns, denominator column) of each ratio printed: how many times faster
    gram-kern is than the numerator (the fastest of several where more than one is named)."""
    ratios = []
    for mode in modes:
        others = [f"{n} {mode}" for n in ("gram-torch", "gram-quack") if n in names]
        ratios.append((f"{mode}: kern vs best of torch/quack", others, f"gram-kern {mode}"))
        ratios.append((f"{mode}: kern vs muon", [f"muon {mode}"], f"gram-kern {mode}"))
    if len(modes) == 2:
        ratios.append(("kern graph vs eager", ["gram-kern eager"], "gram-kern graph"))
    return ratios


def row(label: str, ms: dict, columns: list, ratios: list, kern: str) -> str:
    cells = [f"{ms[c]:.3f}" for c in columns]
    cells += [f"{min(ms[n] for n in num) / ms[den]:.2f}x" for _, num, den in ratios]
    eager = "gram-kern eager" in ms and [n for n in ("gram-torch eager", "gram-quack eager") if n in ms]
    target = ""
    if eager:
        best = min(ms[n] for n in eager)
        target = " (eager target met)" if ms["gram-kern eager"] <= EAGER_TARGET * best else " (eager target MISSED)"
    return f"| {label}{target} | " + " | ".join(cells) + f" | {ms['floor']:.3f} | {ms[kern] / ms['floor']:.2f} |"


if __name__ == "__main__":
    main()
