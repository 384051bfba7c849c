"""X @ X^T and symmetric products: CuTe DSL kernel vs torch.matmul (cuBLAS), side by side.

    python benchmarks/bench_symm.py [--dtype bf16|fp16] [--sweep] [--iters N] [--graph]
    python benchmarks/bench_symm.py --dtype fp16 --sweep --graph --tiles 128x128,128x128:p,256x256:p --fit

Every row times cuBLAS, the kernel (each of --tiles) and quack in the same process on the same
inputs, their timed runs interleaved so that the unlocked clocks' drift reaches all alike
(rotating among several input sets so small problems are not served from L2). The FLOP floor counts the
symmetric product at half cost (M^2 K per batch element, multiply-add = 2 FLOPs) at the cuBLAS
peak measured in this run (8192^3 product). quack-kernels' gemm_symmetric is timed where it
imports, on both tables (the symmetric product with its addend, as benchmarks/quack_backend.py runs
Gram NS on it). ``--graph`` times every call replayed from a CUDA graph, as inside the optimizer's
graphed step: the kernels' GPU time without the host's cost per call (the crossovers below which
products stay on cuBLAS were measured eager). ``--fit``: the relative tile throughputs that the
tile model (heuristics.TILE_THROUGHPUT) would need to match this run's per-tile times, and per shape
the tile the model picks today, with them, and the fastest (with ``--graph``, so that the host's
cost per call, which dominates small products eager, stays out of the fit).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from timing import cuda_median_ms, cuda_median_ms_interleaved

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dion3_megatron import kernels  # noqa: E402
from dion3_megatron.kernels.config import tile_shape  # noqa: E402
from dion3_megatron.kernels.symm.heuristics import (  # noqa: E402
    TILE_THROUGHPUT,
    checked_ctas_per_sm,
    default_tile,
    modelled_tile_time,
    stream_k_pays,
)
from dion3_megatron.kernels.symm.launch import symm_gemm  # noqa: E402
from quack_backend import quack_gemm_symmetric  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# (batch, M, K): the X @ X^T shapes of 14B-class matrices, the last the K/V batch's Gram
GRAM_SHAPES = [(1, 1024, 5120), (1, 4096, 4096), (1, 4096, 16384), (1, 8192, 8192), (8, 4096, 16384), (16, 1024, 5120)]
# symmetric s x s products of Gram NS (K = s) for those shapes and a sweep for routing
SYMM_SHAPES = [(1, 1024, 1024), (1, 2048, 2048), (1, 5120, 5120), (1, 4096, 4096), (8, 1024, 1024), (16, 1024, 1024)]
SWEEP = (
    [(1, m, k) for m in (512, 1024, 2048, 3072, 4096) for k in (m, 4 * m)]
    + [(1, 3456, 5120), (1, 5120, 13824), (1, 6144, 6144), (1, 12288, 4096)]
    + [(b, 1024, 5120) for b in (2, 4, 8, 16)]
    + [(b, 1024, 1024) for b in (4, 8, 16)]
    + [(2, 2048, 8192), (2, 2048, 2048)]
)


GRAPH = False  # --graph


def timed(fns: dict, n_sets: int, iters: int) -> dict:
    """name -> median ms per call: 7 reps of ``iters`` calls rotating over ``n_sets`` inputs, the
    variants' reps interleaved."""
    return cuda_median_ms_interleaved(fns, n_sets, iters, reps=7, warmup=3, graph=GRAPH)


def cublas_peak(dtype) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = cuda_median_ms(lambda i: torch.matmul(a, b), 1, 10, reps=7, warmup=3)
    return 2 * n**3 / (ms * 1e-3)


def kernel_choice(tile):
    """'TILE[@CTAS][:p][:k][:sN][:gN]' (CTAs per SM, e.g. 64@3; :p the persistent launch; :k the
    persistent launch with stream-K; :sN a pipeline of N stages; :gN a tile order in bands of N
    block rows, KernelConfig.tile_group) -> (tile, ctas_per_sm, persistent, stages, tile_group,
    stream_k); None or 'auto': the automatic choice (a tile without @ runs at its default CTAs per SM)."""
    if tile is None or tile == "auto":
        return None, None, None, None, kernels.current().tile_group, None
    tile, *launch = tile.split(":")
    persistent, stages, group, stream_k = False, None, kernels.current().tile_group, False
    for suffix in launch:
        if suffix == "p":
            persistent = True
        elif suffix == "k":
            persistent = stream_k = True
        elif suffix[:1] == "s" and suffix[1:].isdigit():
            stages = int(suffix[1:])
        elif suffix[:1] == "g" and suffix[1:].isdigit():
            group = int(suffix[1:])
        else:
            raise SystemExit(
                "--tiles: a launch suffix must be ':p' (persistent), ':k' (stream-K), ':sN' (N stages) "
                f"or ':gN' (bands of N block rows), got {suffix!r}"
            )
    shape, _, ctas = tile.partition("@")
    return shape, int(ctas) if ctas else None, persistent, stages, group, stream_k


def run_rows(title, shapes, dtype, peak, iters, gram: bool, tiles=(None,)):
    if not shapes:
        return []
    quack = quack_gemm_symmetric()
    print(f"\n## {title} ({str(dtype).split('.')[-1]})")
    hdr = "| shape | cuBLAS ms | kernel ms | kernel vs cuBLAS | floor ms | kernel / floor |"
    if quack is not None:
        hdr += " quack ms | quack vs cuBLAS |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    rows = []
    for b, m, k in shapes:
        n_sets = max(1, min(8, int(4e8 // (b * m * k * 2 + 1))))
        if gram:
            xs = [torch.randn(b, m, k, device="cuda", dtype=dtype) for _ in range(n_sets)]
            ys = xs
        else:
            xs, ys = [], []
            for _ in range(n_sets):
                s = torch.randn(b, m, m, device="cuda", dtype=torch.float32) / m**0.5
                s = s + s.mT
                xs.append(s.to(dtype))
                ys.append((s @ s).to(dtype))
        outs = [torch.empty(b, m, m, device="cuda", dtype=dtype) for _ in range(n_sets)]

        def cub(i):
            if gram:
                torch.matmul(xs[i], ys[i].mT, out=outs[i])
            else:  # the Gram NS form: alpha * P @ Q + beta * P
                torch.baddbmm(xs[i], xs[i], ys[i], beta=-0.5, alpha=1.5, out=outs[i])

        def ker(i, shape, ctas, persistent, stages, group, stream_k):
            launch = dict(out=outs[i], tile=shape, ctas_per_sm=ctas, persistent=persistent, stages=stages, stream_k=stream_k)
            with kernels.using(tile_group=group):
                if gram:
                    symm_gemm(xs[i], ys[i], 1.0, 0.0, None, **launch)
                else:
                    symm_gemm(xs[i], ys[i], 1.5, -0.5, xs[i], **launch)

        def quack_call(i):  # as benchmarks/quack_backend.py calls it: A (M, K), B (K, M), C (M, M)
            p, q = (xs[i][0], ys[i][0]) if b == 1 else (xs[i], ys[i])
            if gram:
                quack(p, p.mT)
            else:
                quack(p, q.mT, C=p, alpha=1.5, beta=-0.5)

        choices = {tile: kernel_choice(tile) for tile in tiles}
        variants = {"cuBLAS": cub}
        variants.update({tile: lambda i, choice=choice: ker(i, *choice) for tile, choice in choices.items()})
        if quack is not None:
            variants["quack"] = quack_call
        try:
            ms = timed(variants, n_sets, iters)
        except Exception as exc:  # noqa: BLE001 - quack's kernel failing on a shape it does not take
            if quack is None:
                raise
            print(f"quack failed ({type(exc).__name__}: {exc}); this shape without it", flush=True)
            del variants["quack"]
            ms = timed(variants, n_sets, iters)
        t_cub = ms["cuBLAS"]
        best, per_tile, by_shape = None, [], {}
        for tile in tiles:
            t = ms[tile]
            per_tile.append(f"{tile}: {t:.3f}")
            shape = choices[tile][0]
            if shape is not None:
                key = tile_shape(shape)
                by_shape[key] = min(t, by_shape.get(key, t))
            if best is None or t < best[0]:
                best = (t, tile)
        t_ker, tile = best
        floor = b * m * m * k / peak * 1e3  # half of 2 M^2 K
        name = f"{b}x{m}x{k}" if b > 1 else f"{m}x{k}"
        if choices[tile][0] is None:  # the automatic choice: its tile, and :k where it splits along K
            shape = default_tile(m, b, k)
            chosen = ("auto " if tile else "") + "x".join(map(str, shape)) + f"@{checked_ctas_per_sm(*shape, None)}"
            chosen += ":k" if stream_k_pays(b, m, k, shape) else ""
        else:
            chosen = tile
        line = f"| {name} (tile {chosen}) | {t_cub:.3f} | {t_ker:.3f} | {t_cub / t_ker:.2f}x | {floor:.3f} | {t_ker / floor:.2f} |"
        if "quack" in ms:
            line += f" {ms['quack']:.3f} | {t_cub / ms['quack']:.2f}x |"
        elif quack is not None:
            line += " failed | |"
        if len(per_tile) > 1:
            line += f" ms per tile: {', '.join(per_tile)}"
        print(line, flush=True)
        rows.append((b, m, by_shape))
    return rows


def fit_tile_throughputs(rows, sms: int) -> None:
    """Print the throughput per tile shape (relative to the first one measured everywhere) that
    makes heuristics.modelled_tile_time proportional to this run's times: per shape, each tile's
    modelled time at throughput 1 over its measured time, relative to the reference tile's, and the
    geometric mean over the shapes; then per shape the fastest tile against the model's picks. A
    tile shape measured in several launches (128x256 and 128x256:p) counts by its fastest. The picks
    here are the whole-wave model's alone, among the tiles measured: default_tile also counts
    stream-K's waves (SPLIT_WAVE_COST) and offers L2_BOUND_TILES only to operands over half the L2."""
    rows = [(b, m, times) for b, m, times in rows if len(times) > 1]
    common = [t for t in rows[0][2] if all(t in times for _, _, times in rows)] if rows else []
    if not common:
        print("\n--fit: needs two or more --tiles measured on every shape")
        return
    ref = common[0]

    def unit(b, m, shape, ms):  # modelled time at throughput 1 per measured ms
        return modelled_tile_time(m, b, shape, 1.0, sms) / ms

    fitted = {}
    for shape in rows[0][2]:
        logs = [math.log(unit(b, m, shape, times[shape]) / unit(b, m, ref, times[ref])) for b, m, times in rows if shape in times]
        fitted[shape] = math.exp(sum(logs) / len(logs))

    def pick(b, m, times, throughput):
        return min(times, key=lambda shape: modelled_tile_time(m, b, shape, throughput[shape], sms))

    def name(shape):
        return "x".join(map(str, shape))

    scale = TILE_THROUGHPUT[ref]
    print("\n## Tile throughputs fitted to this run (relative; the model's reference tile at its value)")
    print("| tile | fitted | heuristics.TILE_THROUGHPUT |\n|---|---|---|")
    for shape, value in fitted.items():
        print(f"| {name(shape)} | {value * scale:.3f} | {TILE_THROUGHPUT[shape]:.3f} |")
    print("\n| shape | fastest ms | the model's pick today, ms | with the fitted throughputs, ms |\n|---|---|---|---|")
    losses = {"today": [], "fitted": []}
    for b, m, times in rows:
        best = min(times, key=times.get)
        cells = []
        for label, throughput in (("today", TILE_THROUGHPUT), ("fitted", fitted)):
            chosen = pick(b, m, times, throughput)
            losses[label].append(times[chosen] / times[best])
            cells.append(f"{name(chosen)} {times[chosen]:.3f}")
        print(f"| {b}x{m} | {name(best)} {times[best]:.3f} | " + " | ".join(cells) + " |")
    for label, values in losses.items():
        print(
            f"{label}: the picks take {max(values):.3f}x the fastest at worst, "
            f"{math.exp(sum(map(math.log, values)) / len(values)):.3f}x on geometric mean"
        )


def overhead(dtype):
    """Per-call time of a product too small to occupy the GPU: back to back, eager, the host's cost
    per call (our launch, cuBLAS's, quack's) is what the events measure."""
    x = torch.randn(1, 128, 128, device="cuda", dtype=dtype)
    out = torch.empty(1, 128, 128, device="cuda", dtype=dtype)
    fns = {
        "kernel": lambda i: symm_gemm(x, x, 1.0, 0.0, None, out=out),
        "kernel + beta C": lambda i: symm_gemm(x, x, 1.0, 0.5, out, out=out),
        "cuBLAS": lambda i: torch.matmul(x, x.mT, out=out),
    }
    quack = quack_gemm_symmetric()
    if quack is not None:
        fns["quack"] = lambda i: quack(x[0], x[0].mT, out=out[0], alpha=1.0, beta=1.0)
    ms = cuda_median_ms_interleaved(fns, 1, 200, reps=7, warmup=3)
    print(
        "\nper-call time of a 128x128x128 product, eager (the host's cost per call): "
        + ", ".join(f"{name} {t * 1e3:.1f} us" for name, t in ms.items())
    )


def chosen_shapes(spec: str) -> tuple[list, list]:
    """--shapes: the X @ X^T and the symmetric products' (batch, M, K)."""
    gram, symm = [], []
    for item in spec.split(","):
        kind, _, dims = item.partition(":")
        if kind not in ("gram", "symm") or len(dims.split("x")) != 3:
            raise SystemExit(f"--shapes: {item!r} is not gram:BxMxK or symm:BxMxK")
        (gram if kind == "gram" else symm).append(tuple(int(d) for d in dims.split("x")))
    return gram, symm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also the routing sweep")
    ap.add_argument(
        "--tiles",
        default="",
        help="comma list of tiles to try, each TILE or TILE@CTAS (CTAs kept "
        "resident per SM; TILE alone: its default), :p for the persistent launch, :k for it with stream-K, "
        ":sN for N pipeline stages, "
        ":gN for a tile order in bands of N block rows, e.g. 64@1,64,64@3,128x256,128x256:p,128x256:s3,128x256:p:g8 "
        "(each and the best reported); "
        "default: the automatic choice",
    )
    ap.add_argument("--graph", action="store_true", help="time each call replayed from a CUDA graph")
    ap.add_argument(
        "--shapes",
        default="",
        help="comma list of BxMxK to time instead of the tables' shapes, "
        "each prefixed gram: (X @ X^T) or symm: (the symmetric product, K = M), e.g. "
        "gram:16x1024x5120,symm:16x1024x1024",
    )
    ap.add_argument("--fit", action="store_true", help="fit the tile model's throughputs to the --tiles measured (every table's shapes)")
    args = ap.parse_args()
    global GRAPH
    GRAPH = args.graph
    dtype = DTYPES[args.dtype]
    tiles = tuple(args.tiles.split(",")) if args.tiles else (None,)
    props = torch.cuda.get_device_properties(0)
    import cutlass

    print(
        f"GPU {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
        f"nvidia-cutlass-dsl {getattr(cutlass, '__version__', '?')}"
    )
    peak = cublas_peak(dtype)
    print(f"cuBLAS peak (8192^3, {args.dtype}): {peak / 1e12:.0f} TFLOP/s; {'CUDA-graph replays' if GRAPH else 'eager calls'}")
    overhead(dtype)
    gram_shapes, symm_shapes = chosen_shapes(args.shapes) if args.shapes else (GRAM_SHAPES, SYMM_SHAPES)
    rows = run_rows("X @ X^T", gram_shapes, dtype, peak, args.iters, gram=True, tiles=tiles)
    rows += run_rows(
        "1.5 P @ Q - 0.5 P, P and Q symmetric, commuting (cuBLAS: baddbmm)", symm_shapes, dtype, peak, args.iters, gram=False, tiles=tiles
    )
    if args.sweep:
        rows += run_rows("routing sweep, X @ X^T", SWEEP, dtype, peak, args.iters, gram=True, tiles=tiles)
    if args.fit:
        fit_tile_throughputs(rows, props.multi_processor_count)


if __name__ == "__main__":
    main()
