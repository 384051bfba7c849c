"""The optimizer on a GPU: fp16 Gram NS by default (the engine over NCCL: tests/integration/test_nccl.py)."""

import pytest
import torch

from dion3_megatron import Dion3

pytestmark = pytest.mark.gpu


def test_gradients_usable_on_cuda(generator):
    from unit.test_optimizer import check_gradients_usable

    check_gradients_usable(torch.device("cuda"), generator)


def one_step(device, ns_dtype, weight, grad, fraction):
    p = torch.nn.Parameter(weight.to(device).clone())
    p.grad = grad.to(device).clone()
    Dion3([p], fraction=fraction, ns_dtype=ns_dtype).step()
    return p.detach().double().cpu()


@pytest.mark.parametrize("shape", [(256, 1024), (1024, 256), (512, 512)])
def test_cuda_step_in_fp16_matches_fp64(shape, generator):
    weight = torch.randn(shape, generator=generator)
    grad = torch.randn(shape, generator=generator)
    exact = one_step("cpu", torch.float64, weight, grad, 0.25) - weight.double()
    fast = one_step("cuda", None, weight, grad, 0.25) - weight.double()  # default: fp16 on CUDA
    assert ((fast - exact).norm() / exact.norm()).item() < 2e-2
