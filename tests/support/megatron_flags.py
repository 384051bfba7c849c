"""Megatron-LM flags the tests' runs share."""

from __future__ import annotations

# A GPT on torch's own layers, as the README's commands run it: no Transformer Engine, apex or fused
# kernels (none of them runs on a CPU).
LOCAL_LAYERS = [
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
]
