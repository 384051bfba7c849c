"""GPU memory of the optimizer-step benchmarks, estimated from the shapes before anything is
allocated, in bytes: what a run holds throughout and what each optimizer's step takes on top.

The step's part comes from how the step allocates (dion3_megatron.engine.local, core.ortho), on a
GPU (Newton-Schulz in fp16 for Dion3, bf16 for Muon):

* one orthogonalization of a batch of B blocks of k x c selected rows: its fp16 input and its fp16
  result (2 bytes per element each), and Gram Newton-Schulz's four s x s products, s = min(k, c)
  (a square block takes standard Newton-Schulz: two);
* a Dion3 step: the fp32 copy of the selected rows of every shape where f < 1 (held through the
  step), then the orthogonalizations one shape after another, each beside the previous one's
  result; a graphed step keeps that peak in its CUDA graph's pool, one pool per optimizer;
* Muon's eager step on a k x c matrix: three bf16 copies of it and two s x s products.

The single-matrix terms give exactly the extra memory measured on an H100 for a 65536 x 8192 and an
8192 x 65536 matrix (benchmarks/results/wide-1xh100.json; tests/unit/test_step_memory.py checks it). The
batched steps' totals are estimates until a run prints its peak (bench_step.py prints both).
"""

from __future__ import annotations

from collections import Counter
from typing import Union

GIB = 2**30
FRACTIONS: tuple[Union[float, str], ...] = (1.0, 0.25, 0.125, "auto")  # bench_step.py's Dion3 optimizers
AUTO_CHOICES = (1.0, 0.5, 0.25, 0.125)  # what fraction="auto" picks from, per shape
LAYER_COUNTS = (8, 4, 2, 1)  # bench_step.py's default: the first whose estimate fits the GPU
FITS = 0.9  # of the GPU's memory: what an estimate may take (the allocator's own overhead beside it)


def orthogonalization_bytes(k: int, c: int, batch: int = 1) -> int:
    """Extra memory of orthogonalizing ``batch`` blocks of k x c rows in fp16."""
    s = min(k, c)
    return batch * (2 * k * c + 2 * k * c + (2 if k == c else 4) * 2 * s * s)


def selected_rows(n: int, fraction: float) -> int:
    return n if fraction >= 1 else max(1, round(n * fraction))


def dion3_step_bytes(groups: list[tuple[int, int, int]], fraction: float) -> int:
    """Peak extra memory of one Dion3 step over same-shape groups (n, c, batch) at one f."""
    rows = [(selected_rows(n, fraction), n, c, batch) for n, c, batch in groups]
    copies = sum(4 * k * c * batch for k, n, c, batch in rows if k < n)
    results = [2 * k * c * batch for k, _, c, batch in rows]
    return copies + max(orthogonalization_bytes(k, c, batch) + (results[i - 1] if i else 0) for i, (k, _, c, batch) in enumerate(rows))


def auto_step_bytes(groups: list[tuple[int, int, int]]) -> int:
    """A bound on fraction="auto"'s step, whatever f it picks per shape: every shape's row copy at its
    largest (f = 1/2) and the orthogonalizations at theirs (f = 1)."""
    copies = sum(4 * selected_rows(n, 0.5) * c * batch for n, c, batch in groups)
    return copies + dion3_step_bytes(groups, 1.0)


def muon_step_bytes(n: int, c: int) -> int:
    """Extra memory of Muon's eager step on one n x c matrix (NS5 in bf16)."""
    return 3 * 2 * n * c + 2 * 2 * min(n, c) ** 2


def shape_groups(layer: list[tuple[int, int]], layers: int) -> list[tuple[int, int, int]]:
    """The same-shape groups (n, c, batch) of ``layers`` layers of these matrices, in first-seen order."""
    return [(n, c, count * layers) for (n, c), count in Counter(layer).items()]


def bench_step_bytes(layer: list[tuple[int, int]], layers: int, fractions=FRACTIONS) -> dict[str, int]:
    """bench_step.py's memory: ``state`` (parameters, gradients, Muon's momentum, each Dion3's
    momentum: 4 bytes per parameter each), each Dion3's step (its graph's pool), Muon's step, and
    ``total``."""
    groups = shape_groups(layer, layers)
    parameters = sum(n * c * batch for n, c, batch in groups)
    parts = {"state": 4 * parameters * (3 + len(fractions))}
    for f in fractions:
        parts[f"dion3 f={f}"] = auto_step_bytes(groups) if f == "auto" else dion3_step_bytes(groups, float(f))
    parts["muon"] = max(muon_step_bytes(n, c) for n, c, _ in groups)
    parts["total"] = sum(parts.values())
    return parts


def default_layers(layer: list[tuple[int, int]], gpu_bytes: int) -> int:
    """The most layers of :data:`LAYER_COUNTS` whose estimate fits within :data:`FITS` of the GPU."""
    for layers in LAYER_COUNTS:
        if bench_step_bytes(layer, layers)["total"] <= FITS * gpu_bytes:
            return layers
    return LAYER_COUNTS[-1]


def fsdp2_state_bytes(layer: list[tuple[int, int]], layers: int) -> int:
    """bench_fsdp2.py's parameters, gradients and optimizer states: 4 bytes per parameter each for
    the parameters, the gradients, two Dion3s' momenta (f = 1/4, 1/8), microsoft/dion's Dion3 and
    Muon momenta; 8 for AdamW's two moments (the optimizers' step memory beside it is not counted)."""
    parameters = sum(n * c * batch for n, c, batch in shape_groups(layer, layers))
    return parameters * (4 * 6 + 8)
