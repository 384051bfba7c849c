"""The symmetric-GEMM kernel compiles for sm_90a in every configuration the launch can pick, on a
machine without a GPU (CuTe DSL needs none to compile): a kernel edit that does not build is
caught before a GPU run. Runs where nvidia-cutlass-dsl is installed (the ``kernels`` extra);
what the kernels compute is tested on the GPU (tests/unit/test_kernels_gpu.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (the kernels extra) is not installed")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi (the kernels extra) is not installed")

import cutlass  # noqa: E402

from dion3_megatron.kernels.symm import kernel as sm90  # noqa: E402
from dion3_megatron.kernels.symm.launch import compile_kernel  # noqa: E402

F16, BF16 = cutlass.Float16, cutlass.BFloat16
SMS = 132  # an H200's: a persistent grid is one CTA per SM


@pytest.mark.slow
@pytest.mark.parametrize("tile, ctas_per_sm", [((64, 64), 2), ((128, 128), 1), ((128, 256), 1), ((256, 128), 1), ((256, 256), 1)])
@pytest.mark.parametrize("launch", ["per tile", "persistent"])
@pytest.mark.parametrize("operands", ["gram", "+ beta C", "M-major + beta C"])
def test_the_kernel_compiles_without_a_gpu(tile, ctas_per_sm, launch, operands):
    c = F16 if "C" in operands else None
    persistent_ctas = SMS * ctas_per_sm if launch == "persistent" else None
    kernel = sm90.SymmGemmSm90(F16, F16, c, tile, None, operands.startswith("M-major"), ctas_per_sm, persistent_ctas)
    fn = compile_kernel(kernel)
    assert len(fn.kernel_info) == 1  # one device kernel, built for the launch


@pytest.mark.slow
@pytest.mark.parametrize("tile", [(128, 128), (128, 256), (256, 128), (256, 256)])
def test_the_row_by_row_tile_order_compiles_without_a_gpu(tile):
    kernel = sm90.SymmGemmSm90(F16, F16, F16, tile, None, False, 1, SMS, tile_group=1)
    assert len(compile_kernel(kernel).kernel_info) == 1


@pytest.mark.slow
def test_a_bf16_kernel_with_a_float32_result_compiles_without_a_gpu():
    kernel = sm90.SymmGemmSm90(BF16, cutlass.Float32, cutlass.Float32, (128, 256))
    assert len(compile_kernel(kernel).kernel_info) == 1


@pytest.mark.slow
@pytest.mark.parametrize("tile", [(128, 128), (128, 256)])
@pytest.mark.parametrize("operands", ["gram", "+ beta C", "M-major + beta C"])
def test_the_stream_k_launch_compiles_without_a_gpu(tile, operands):
    c = F16 if "C" in operands else None
    kernel = sm90.SymmGemmSm90(F16, F16, c, tile, None, operands.startswith("M-major"), 1, SMS, stream_k=True)
    assert len(compile_kernel(kernel).kernel_info) == 1


def test_stream_k_needs_a_persistent_launch_of_single_ctas():
    with pytest.raises(ValueError, match="stream_k needs a persistent launch of single CTAs"):
        sm90.SymmGemmSm90(F16, F16, None, (256, 256), None, False, 1, SMS, stream_k=True)
    with pytest.raises(ValueError, match="stream_k needs a persistent launch of single CTAs"):
        sm90.SymmGemmSm90(F16, F16, None, (128, 128), stream_k=True)
