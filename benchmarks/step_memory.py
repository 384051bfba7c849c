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
from dataclasses import dataclass
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


# ------------------------------------------------------------------------------------------------
# The documented GPU commands that are not optimizer-step benchmarks: estimates per GPU, from the
# shapes each script builds (docs/performance.md's table of every command; tests/unit/test_step_memory.py).

MIB = 2**20


def size_text(value: int) -> str:
    """How the docs write an estimate: GiB to one decimal, or MiB below a tenth of a GiB."""
    return f"{value / GIB:.1f} GiB" if value >= 0.1 * GIB else f"{value / MIB:.0f} MiB"


def ortho_bench_bytes(shapes: list[tuple[int, int, int]], variants: int, muon: bool = True, sets: int = 2) -> int:
    """bench_ortho.py at its largest shape: ``sets`` fp32 inputs of (batch, rows, cols), and per
    variant one CUDA graph per input, each graph's pool holding that orthogonalization's working
    memory (Gram Newton-Schulz in fp16; the Muon column NS5 in bf16), plus one eager call beside them."""

    def at(batch: int, rows: int, cols: int) -> int:
        gram = orthogonalization_bytes(rows, cols, batch)
        ns5 = batch * muon_step_bytes(rows, cols)
        graphs = sets * ((variants - muon) * gram + muon * ns5)
        return sets * 4 * batch * rows * cols + graphs + max(gram, ns5)

    return max(at(*shape) for shape in shapes)


def eager_bench_bytes(normalized: list[tuple[int, int, int]], boundary: list[tuple[str, int, int, int]]) -> int:
    """bench_eager.py's largest table: the normalization (two fp32 inputs, two forms each graphed per
    input holding an fp16 result, one eager result beside them) or the products near the thresholds
    (four fp16 operands, one result)."""
    norm = max(2 * 4 * b * r * c + (2 * 2 + 1) * 2 * b * r * c for b, r, c in normalized)
    products = max(4 * 2 * b * m * (k if kind == "gram" else m) + 2 * b * m * m for kind, b, m, k in boundary)
    return max(norm, products)


def megabatch_bytes(layer: list[tuple[int, int]], layers: int, world: int) -> int:
    """bench_megabatch.py per rank: each matrix's 1/world shard as fp32 weight, gradient and momentum,
    and the step counted as a gathered fp32 copy of every whole matrix and their orthogonalization at f = 1."""
    groups = shape_groups(layer, layers)
    parameters = sum(n * c * batch for n, c, batch in groups)
    return 3 * 4 * parameters // world + 4 * parameters + dion3_step_bytes(groups, 1.0)


@dataclass(frozen=True)
class Gpt:
    """A GPT's shapes as a training command builds them (ffn 0: 4 x hidden; query_groups 0: one
    per head; gated: SwiGLU, fc1 holding gate and up; positions: rows of a learned position table)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0
    query_groups: int = 0
    gated: bool = False
    tied: bool = False
    positions: int = 0
    biases: bool = False

    def matrix_parameters(self) -> int:
        """The layers' weight matrices: what Dion3 (or Muon) steps."""
        h, f = self.hidden, self.ffn or 4 * self.hidden
        kv = 2 * h * (h // self.heads) * (self.query_groups or self.heads)
        return self.layers * (2 * h * h + kv + (3 if self.gated else 2) * h * f)

    def other_parameters(self) -> int:
        """Embeddings, output layer, position table, norms (two vectors each) and biases: AdamW's."""
        h, f = self.hidden, self.ffn or 4 * self.hidden
        biases = (3 * h + h + (2 if self.gated else 1) * f + h) if self.biases else 0
        return self.vocab * h * (1 if self.tied else 2) + self.positions * h + self.layers * (4 * h + biases) + 2 * h


@dataclass(frozen=True)
class Layout:
    """Bytes per parameter and how the ranks divide them. shard: "zero1" divides the main weights and
    the optimizer's state over the data-parallel ranks (Megatron's distributed optimizer, ZeRO-1),
    "full" divides everything (FSDP2, ZeRO-3), "none" nothing. main 0: the weights are fp32 themselves.
    momentum: bytes per matrix parameter on the GPU (Dion3's or Muon's fp32 momentum 4, bf16 2,
    offloaded 0; an Adam run 8); adam: bytes per other parameter."""

    gpus: int = 1
    tp: int = 1
    shard: str = "zero1"
    weights: int = 2
    main: int = 4
    grads: int = 4
    momentum: int = 4
    adam: int = 8


def training_bytes(
    model: Gpt, micro_batch: int, layout: Layout, fused_attention: bool = False, activation_bytes: int = 2
) -> dict[str, int]:
    """One GPU's memory in a training run: ``state`` (weights, main weights, gradients, the optimizer's
    state, divided as the layout shards them), ``activations`` and ``total``.

    Activations follow Korthikanti et al. 2022 (no recomputation, 16-bit): s b h (10 + 24 / t +
    5 a s / (h t)) bytes per layer at tensor-parallel size t, with the attention scores' 5 a s / (h t)
    left out where a fused attention kernel keeps none (the paper's selective recomputation), and the
    output layer's fp32 logits, 4 s b v / t; ``activation_bytes`` 4 doubles the layers' for fp32 runs."""
    t, dp = layout.tp, layout.gpus // layout.tp
    matrices, others = model.matrix_parameters() // t, model.other_parameters() // t
    every = dp if layout.shard == "full" else 1
    optimizer = dp if layout.shard in ("zero1", "full") else 1
    state = (layout.weights + layout.grads) * (matrices + others) // every
    state += (layout.main * (matrices + others) + layout.momentum * matrices + layout.adam * others) // optimizer
    s, b, h, a = model.seq, micro_batch, model.hidden, model.heads
    per_layer = s * b * h * (10 + 24 / t + (0 if fused_attention else 5 * a * s / (h * t)))
    activations = int(model.layers * per_layer * activation_bytes / 2 + 4 * s * b * model.vocab / t)
    return {"state": state, "activations": activations, "total": state + activations}
