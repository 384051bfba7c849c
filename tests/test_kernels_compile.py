"""The symmetric-GEMM kernel compiles for sm_90a in every configuration the launch can pick, on a
machine without a GPU (CuTe DSL needs none to compile): a kernel edit that does not build is
caught before a GPU run. Runs where nvidia-cutlass-dsl is installed (the ``kernels`` extra);
what the kernels compute is tested on the GPU (tests/test_kernels_gpu.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (the kernels extra) is not installed")

import cutlass  # noqa: E402

from dion3_megatron.kernels import sm90_symm  # noqa: E402

F16, BF16 = cutlass.Float16, cutlass.BFloat16
SMS = 132  # an H200's: a persistent grid is one CTA per SM


@pytest.mark.slow
@pytest.mark.parametrize("tile, ctas_per_sm", [((64, 64), 2), ((128, 128), 1), ((128, 256), 1), ((256, 128), 1),
                                               ((256, 256), 1)])
@pytest.mark.parametrize("launch", ["per tile", "persistent"])
@pytest.mark.parametrize("operands", ["gram", "+ beta C", "M-major + beta C"])
def test_the_kernel_compiles_without_a_gpu(tile, ctas_per_sm, launch, operands):
    c = F16 if "C" in operands else None
    persistent_ctas = SMS * ctas_per_sm if launch == "persistent" else None
    kernel = sm90_symm.SymmGemmSm90(F16, F16, c, tile, None, operands.startswith("M-major"), ctas_per_sm,
                                    persistent_ctas)
    fn = sm90_symm.compile_kernel(kernel)
    assert len(fn.kernel_info) == 1  # one device kernel, built for the launch


@pytest.mark.slow
@pytest.mark.parametrize("tile", [(128, 128), (128, 256), (256, 128), (256, 256)])
def test_the_row_by_row_tile_order_compiles_without_a_gpu(tile):
    kernel = sm90_symm.SymmGemmSm90(F16, F16, F16, tile, None, False, 1, SMS, tile_group=1)
    assert len(sm90_symm.compile_kernel(kernel).kernel_info) == 1


@pytest.mark.slow
def test_a_bf16_kernel_with_a_float32_result_compiles_without_a_gpu():
    kernel = sm90_symm.SymmGemmSm90(BF16, cutlass.Float32, cutlass.Float32, (128, 256))
    assert len(sm90_symm.compile_kernel(kernel).kernel_info) == 1


@pytest.mark.slow
@pytest.mark.parametrize("tile", [(128, 128), (128, 256)])
@pytest.mark.parametrize("operands", ["gram", "+ beta C", "M-major + beta C"])
def test_the_stream_k_launch_compiles_without_a_gpu(tile, operands):
    c = F16 if "C" in operands else None
    kernel = sm90_symm.SymmGemmSm90(F16, F16, c, tile, None, operands.startswith("M-major"), 1, SMS, stream_k=True)
    assert len(sm90_symm.compile_kernel(kernel).kernel_info) == 1


def test_stream_k_needs_a_persistent_launch_of_single_ctas():
    with pytest.raises(ValueError, match="stream_k needs a persistent launch of single CTAs"):
        sm90_symm.SymmGemmSm90(F16, F16, None, (256, 256), None, False, 1, SMS, stream_k=True)
    with pytest.raises(ValueError, match="stream_k needs a persistent launch of single CTAs"):
        sm90_symm.SymmGemmSm90(F16, F16, None, (128, 128), stream_k=True)


@pytest.fixture
def h200(monkeypatch):
    """The tile model at an H200's SM count and L2 cache (50 MiB), its cached picks made afresh."""
    monkeypatch.setattr(sm90_symm, "_sm_count", lambda: SMS)
    monkeypatch.setattr(sm90_symm, "resident_clusters", lambda cluster_m: SMS // cluster_m)
    monkeypatch.setattr(sm90_symm, "_l2_bytes", lambda: 50 * 2**20)
    sm90_symm.default_tile.cache_clear()
    yield
    sm90_symm.default_tile.cache_clear()


def test_stream_k_where_the_last_wave_would_leave_sms_idle(h200):
    """The automatic choice (sm90_symm.stream_k_pays and the tile model), at an H200's SM count:
    split where the tiles leave the last wave part empty, with a long enough share per CTA."""
    pays = sm90_symm.stream_k_pays
    assert pays(1, 2048, 2048, (128, 128))  # 136 tiles: a second wave of 4
    assert pays(1, 5120, 5120, (128, 128))  # 820: 7 waves 0.89 full
    assert not pays(1, 4096, 4096, (128, 128))  # 528: 4 whole waves
    assert not pays(1, 3456, 5120, (128, 128))  # 378: 0.95 full
    assert not pays(1, 3072, 12288, (128, 128))  # K above SPLIT_MAX_K
    assert not pays(16, 1024, 1024, (128, 128))  # a CTA's share of 22 K blocks
    assert not pays(1, 2048, 2048, (128, 256)) and not pays(1, 2048, 2048, (256, 256))
    assert sm90_symm.default_tile(2048, 1, 8192) == (128, 128)  # split: 1.03 waves, not 2
    assert sm90_symm.default_tile(2048, 1, 8192, split_allowed=False) == (64, 64)
    assert sm90_symm.default_tile(5120, 1, 5120) == (128, 128)


def test_the_256x128_cluster_where_an_operand_overflows_half_the_l2(h200):
    """The tile model at an H200's SM count and L2 (50 MiB): 256 x 128 (two 128 x 128 CTAs sharing
    B) for the K/V batch's products and the wide Gram, not where the operands fit in L2, and not
    where 128 x 128 fills whole waves or stream-K evens out the last one."""
    tile = sm90_symm.default_tile
    assert tile(1024, 16, 5120) == (256, 128) and tile(1024, 16, 1024) == (256, 128)
    assert tile(5120, 1, 13824) == (256, 128)
    assert tile(1024, 8, 1024) == (128, 128)  # 16 MiB operands: fits
    assert tile(4096, 1, 16384) == (128, 128)  # 4 whole waves
    assert tile(5120, 1, 5120) == (128, 128) and sm90_symm.stream_k_pays(1, 5120, 5120, (128, 128))
    assert not sm90_symm.stream_k_pays(16, 1024, 5120, (256, 128))  # clusters never split
