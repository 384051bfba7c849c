"""Megatron-LM's ``pretrain()`` with ``--optimizer dion3 --use-distributed-optimizer --bf16`` on one
GPU (examples/megatron_lm_pretrain_gpt.py through the launcher, ``--deterministic-mode`` so that two
runs of the same flags repeat each other bit for bit): Megatron's ``--optimizer-cpu-offload`` keeps
Dion3's state in host memory, streams it through the GPU, and trains as the run without it,
checkpoint for checkpoint; ``--use-precision-aware-optimizer --exp-avg-dtype bf16`` stores the
momentum in bf16, resumes exactly, and offloads as the fp32 momentum does. The same flags on CPU
ranks: test_megatron_pretrain.py."""

from __future__ import annotations

import os
import re
from typing import Callable

import pytest

from .test_megatron_pretrain import SCRIPT, TINY, assert_same_checkpoint, checkpoint, dion3_momenta, iterations, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GPU = ["--bf16", "--deterministic-mode", "--dion3-fraction", "0.5"]
OFFLOAD = ("--use-precision-aware-optimizer", "--optimizer-cpu-offload")
BF16_MOMENTUM = ("--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16")
STREAMED = "Dion3 offload: the state lives in host memory and streams to cuda:0 for each step"


def on_gpu(args: list[str]) -> str:
    """TINY with ``args`` on one GPU through the launcher: its output."""
    code, out = torchrun(["-m", "dion3_megatron.megatron.launch", SCRIPT, *TINY, *GPU, *args], nproc=1, timeout=400)
    assert code == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Callable[[tuple[str, ...]], tuple[dict, str]]:
    """``saved(args)``: a run of ``args`` saved, once in the module: its losses and gradient norms,
    and the directory it saved in."""
    runs: dict[tuple[str, ...], tuple[dict, str]] = {}

    def run(args: tuple[str, ...]) -> tuple[dict, str]:
        if args not in runs:
            directory = str(tmp_path_factory.mktemp("run") / "saved")
            log = on_gpu([*args, "--save", directory])
            assert "Using LayerWiseDistributedOptimizer for dion3" in log
            assert "HybridDeviceOptimizer" not in log  # (Megatron's CPU Adam: not built for a Dion3 run)
            assert (STREAMED in log) == ("--optimizer-cpu-offload" in args), log[-3000:]
            runs[args] = iterations(log), directory
        return runs[args]

    return run


def at(directory: str, iteration: int) -> dict:
    return checkpoint(os.path.join(directory, f"iter_{iteration:07d}"))


@pytest.mark.parametrize("momentum", [(), BF16_MOMENTUM], ids=["fp32-momentum", "bf16-momentum"])
def test_pretrain_with_optimizer_cpu_offload_on_a_gpu_trains_and_saves_as_without_it(saved, momentum):
    plain, plain_dir = saved(momentum)
    offloaded, offloaded_dir = saved((*momentum, *OFFLOAD))
    assert sorted(plain) == [1, 2, 3, 4] and float(plain[4][0]) < float(plain[1][0])
    assert offloaded == plain
    for iteration in (2, 4):  # (--use-precision-aware-optimizer with fp32 moments changes nothing)
        assert_same_checkpoint(at(plain_dir, iteration), at(offloaded_dir, iteration))


def test_pretrain_with_bf16_momentum_on_a_gpu_saves_it_in_bf16_and_resumes_exactly(saved, tmp_path):
    import torch

    losses, full = saved(BF16_MOMENTUM)
    momenta, group = dion3_momenta(os.path.join(full, "iter_0000004"))
    assert momenta and {v.dtype for v in momenta.values()} == {torch.bfloat16}
    assert group["momentum_dtype"] == "bf16" and group["rounding_step"] == 4
    resumed = str(tmp_path / "resumed")
    log = on_gpu([*BF16_MOMENTUM, "--load", full, "--ckpt-step", "2", "--save", resumed])
    assert re.search(r"^ +dion3_momentum_dtype \.+ bf16$", log, re.M)
    again = iterations(log)
    # (iteration 4 logs a running mean of the losses since the run's start: the grad norm compares)
    assert sorted(again) == [3, 4] and again[3] == losses[3] and again[4][1] == losses[4][1]
    assert_same_checkpoint(at(full, 4), at(resumed, 4))
