"""GPU memory of each documented GPU command that trains or benchmarks outside bench_step.py, per GPU,
estimated by step_memory.py from the shapes each script builds (its flags and defaults, read here as
they are in the script). docs/performance.md states these; tests/unit/test_command_memory.py recomputes them.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchmarks import each other as the scripts they are
    sys.path.insert(0, str(HERE))

from bench_megabatch import layer_matrices  # noqa: E402
from bench_megatron import parse as bench_megatron_args  # noqa: E402
from step_memory import Gpt, Layout, eager_bench_bytes, megabatch_bytes, ortho_bench_bytes, training_bytes  # noqa: E402

ADAM_RUN = 8  # an Adam run's bytes per matrix parameter: the largest of a comparison's runs

# Megatron-LM's GPT at its defaults (learned positions, tied embeddings, biases, a 4h GELU MLP).
MEGATRON_12X1024 = Gpt(layers=12, hidden=1024, heads=16, vocab=32768, seq=1024, tied=True, positions=1024, biases=True)
MEGATRON_4X256 = Gpt(layers=4, hidden=256, heads=4, vocab=32768, seq=256, tied=True, positions=256, biases=True)
MEGATRON_8X1024 = Gpt(layers=8, hidden=1024, heads=16, vocab=32768, seq=1024, tied=True, positions=1024, biases=True)
MEGATRON_8X1024_UNTIED = Gpt(layers=8, hidden=1024, heads=16, vocab=32768, seq=1024, positions=1024, biases=True)


def compare_size(size: str) -> Gpt:
    """examples/megatron_lm/compare_on_gpus.sh's SIZE: GQA (4 groups), SwiGLU, no biases, untied."""
    layers, hidden, ffn = {"202m": (12, 1024, 2816), "350m": (24, 1024, 2816), "1.3b": (24, 2048, 5632)}[size]
    return Gpt(layers=layers, hidden=hidden, heads=16, vocab=32768, seq=1024, ffn=ffn, query_groups=4, gated=True)


def small_gpt(width: int, layers: int, heads: int, seq: int) -> Gpt:
    """examples/small_gpt.py's GPT: bytes (vocab 256), learned positions, untied, no biases."""
    return Gpt(layers=layers, hidden=width, heads=heads, vocab=256, seq=seq, positions=seq)


def bench_megatron_gpt() -> Gpt:
    a = bench_megatron_args([])
    return Gpt(a.layers, a.hidden, a.heads, a.vocab, a.seq, ffn=a.ffn, query_groups=a.heads // 4, gated=True)


# examples/hf_trainer/train.py's Llama-style default: width 512, 8 layers, 8 heads, seq 512, ffn 8/3 width.
HF_LLAMA = Gpt(layers=8, hidden=512, heads=8, vocab=256, seq=512, ffn=512 * 8 // 3 // 64 * 64, gated=True)
# torchtitan's llama3 debugmodel: dim 256, 16 heads, 6 layers, vocab 2048, ffn 768; batch 8 x 2048.
TORCHTITAN_DEBUG = Gpt(layers=6, hidden=256, heads=16, vocab=2048, seq=2048, ffn=768, gated=True)
FP32 = Layout(weights=4, main=0)  # fp32 weights, no separate main copy


def estimates() -> dict[str, dict[str, int]]:
    """Each command's estimate (its parts: state, activations, total), by name."""
    import bench_eager
    import bench_ortho

    megatron = {
        "megatron-lm 12x1024": training_bytes(MEGATRON_12X1024, 8, Layout()),
        "megatron-lm 12x1024 offload": training_bytes(MEGATRON_12X1024, 8, Layout(momentum=0)),
        "megatron-lm 12x1024 bf16 momentum": training_bytes(MEGATRON_12X1024, 8, Layout(momentum=2)),
        "example 4x256": training_bytes(MEGATRON_4X256, 8, Layout()),
        "example 8x1024 tp2": training_bytes(MEGATRON_8X1024, 8, Layout(gpus=8, tp=2)),
        "example 8x1024 fsdp2": training_bytes(MEGATRON_8X1024_UNTIED, 4, Layout(gpus=8, shard="full")),
        "compare 1.3b gpus8 tp2": training_bytes(compare_size("1.3b"), 8, Layout(gpus=8, tp=2, momentum=ADAM_RUN)),
        "compare 350m gpus2 tp2": training_bytes(compare_size("350m"), 8, Layout(gpus=2, tp=2)),
        "compare 350m gpus1": training_bytes(compare_size("350m"), 8, Layout(momentum=ADAM_RUN)),
        "bench_megatron tp2": training_bytes(bench_megatron_gpt(), 8, Layout(gpus=2, tp=2, momentum=ADAM_RUN)),
        "bench_megatron tp1": training_bytes(bench_megatron_gpt(), 8, Layout(gpus=2, momentum=ADAM_RUN)),
    }
    # examples/deepspeed/train_gpt.py: width 512, 8 layers, 8 heads, seq 256 by default; micro-batch 8 (its configs)
    deepspeed = {
        "deepspeed zero1": training_bytes(small_gpt(512, 8, 8, 256), 8, Layout(gpus=2), fused_attention=True),
        "deepspeed zero3": training_bytes(small_gpt(512, 8, 8, 256), 8, Layout(gpus=2, shard="full"), fused_attention=True),
        "deepspeed 606m": training_bytes(small_gpt(2048, 12, 16, 512), 8, Layout(gpus=2, momentum=ADAM_RUN), fused_attention=True),
        # Trainer's default batch, 8 per GPU
        "hf deepspeed": training_bytes(HF_LLAMA, 8, Layout(), fused_attention=True),
    }
    # examples/fsdp2_train.py: width 128, 2 layers, 4 heads, context 128, batch 8, fp32; counted unsharded
    fsdp2 = training_bytes(small_gpt(128, 2, 4, 128), 8, replace(FP32, gpus=2, shard="none"), fused_attention=True, activation_bytes=4)
    torchtitan = {  # fp32 weights and gradients, bf16 compute, flex attention
        "torchtitan dion3": training_bytes(TORCHTITAN_DEBUG, 8, FP32, fused_attention=True),
        "torchtitan adamw": training_bytes(TORCHTITAN_DEBUG, 8, replace(FP32, momentum=ADAM_RUN), fused_attention=True),
    }
    benchmarks = {
        "bench_ortho": ortho_bench_bytes(bench_ortho.SHAPES, variants=4),  # muon, gram-torch, gram-kern, gram-quack
        "bench_eager": eager_bench_bytes(bench_eager.NORMALIZED, bench_eager.BOUNDARY),
        # bench_megabatch.py's defaults: 24 layers, hidden 2048, ffn 8192, on 2 ranks
        "bench_megabatch": megabatch_bytes([shape for _, shape, _ in layer_matrices(2048, 8192)], 24, 2),
    }
    out = {**megatron, **deepspeed, "fsdp2_train": fsdp2, **torchtitan}
    out.update({name: {"total": value} for name, value in benchmarks.items()})
    return out
