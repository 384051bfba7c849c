"""The kernels package on a machine without a GPU: it imports, and dispatch stays on torch."""

import sys
import warnings

import pytest
import torch

from dion3_megatron import kernels
from dion3_megatron.core import ortho
from dion3_megatron.kernels import dispatch
from dion3_megatron.kernels.symm import backend, heuristics


@pytest.fixture(autouse=True)
def _reset():
    yield
    kernels.configure(None)  # back to the environment's defaults


def test_package_imports_without_cutlass_side_effects():
    assert kernels.BACKEND_NAME == "cutedsl"
    assert ortho.get_backend(torch.zeros(1, 4, 8)).name == "torch"


def test_auto_dispatch_falls_back_to_torch_on_cpu():
    kernels.configure(kernels="auto")
    x = torch.randn(2, 64, 256)
    assert ortho.get_backend(x) is kernels.TORCH_BACKEND
    assert ortho.get_backend(x.half()) is kernels.TORCH_BACKEND


def test_override_by_name(generator):
    kernels.configure(backend="cutedsl")
    x = torch.randn(1, 32, 96, generator=generator)
    assert ortho.get_backend(x).name == "cutedsl"
    kernels.configure(backend="torch")
    assert ortho.get_backend(x) is kernels.TORCH_BACKEND
    kernels.configure(backend=None)
    assert ortho.get_backend(x) is kernels.TORCH_BACKEND
    with pytest.raises(ValueError, match="backend must be None or one of"):
        kernels.configure(backend="no-such-backend")
    with pytest.raises(ValueError, match="routing must be one of"):
        kernels.configure(routing="sometimes")
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.configure(kernels="triton")
    with pytest.raises(ValueError, match="tile must be one of"):
        kernels.configure(tile="96x96")


def test_forced_backend_on_cpu_computes_with_torch(generator):
    """Forcing the kernel backend on CPU operands runs every product in torch: same result."""
    g = torch.randn(48, 160, generator=generator)
    with kernels.using(kernels="torch"):
        ref = ortho.gram_newton_schulz(g, dtype=torch.float32)
    kernels.configure(backend="cutedsl", routing="always")
    out = ortho.gram_newton_schulz(g, dtype=torch.float32)
    assert torch.equal(out, ref)


def test_cpu_products_never_route_to_kernels(generator):
    kernels.configure(routing="always")
    x = torch.randn(1, 64, 128, generator=generator).half()
    assert not backend.kernel_capable_device(x)
    r = backend.KERNEL_BACKEND.gram(x.float(), 1.0, 0.0, None)
    assert torch.allclose(r, x.float() @ x.float().mT)


def routes(batch, m, k, dtype):
    return heuristics.routes_to_kernel(batch, m, k, dtype, kernels.current())


def test_routing_rules():
    kernels.configure(routing="measured")
    assert not routes(1, 64, 64, torch.float16)  # tiny: cuBLAS
    # by the tiles the batch fills (one wave of 132 SMs), whatever the batch's split
    assert not routes(1, 1024, 5120, torch.float16)  # 20 tiles
    assert routes(1, 2048, 8192, torch.float16)  # 72, but 2048 wide: stream-K won 1.18x
    assert routes(1, 2048, 2048, torch.float16)
    assert not routes(1, 1536, 6144, torch.float16)  # 42, narrower than min_width
    assert not routes(1, 2048, 16384, torch.float16)  # K beyond what stream-K splits
    assert not routes(4, 1024, 5120, torch.float16)  # 80
    assert routes(1, 3072, 3072, torch.float16)  # 156: won 1.02x
    assert routes(16, 1024, 5120, torch.float16)  # 320
    assert routes(16, 1024, 1024, torch.float16)  # the batch's symmetric products
    assert routes(2, 2048, 2048, torch.float16)  # 144
    assert not routes(1, 8192, 8192, torch.float32)  # fp32: no kernel
    assert not routes(1, 8190, 8192, torch.float16)  # unaligned rows
    kernels.configure(routing="always")
    assert routes(1, 64, 64, torch.float16)
    assert not routes(1, 64, 60, torch.float16)
    # The thresholds are the configuration's.
    kernels.configure(routing="measured", min_tiles=1)
    assert routes(1, 64, 64, torch.float16)
    kernels.configure(routing="measured", min_tiles=132, stream_k=False)  # no stream-K: by the tiles alone
    assert not routes(1, 2048, 8192, torch.float16)
    kernels.configure(routing="measured", stream_k=None, min_width=1024)
    assert routes(1, 1024, 5120, torch.float16)
    for name in ("min_tiles", "min_width"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 0, got -1"):
            kernels.configure(**{name: -1})
    for name in ("persistent", "stream_k"):
        with pytest.raises(ValueError, match=f"{name} must be a bool or None, got 1"):
            kernels.configure(**{name: 1})
    for bad in (0, "8", True):
        with pytest.raises(ValueError, match=f"tile_group must be an int >= 1, got {bad!r}"):
            kernels.configure(tile_group=bad)


def test_a_cpu_operand_never_imports_cutlass(monkeypatch):
    """The kernel backend is registered at import; cutlass is imported only when a kernel runs."""
    # (a test that compiles the kernel may have imported it already in this process)
    for module in ("kernel", "launch"):
        monkeypatch.delitem(sys.modules, f"dion3_megatron.kernels.symm.{module}", raising=False)
    assert ortho.get_backend(torch.zeros(1, 4, 8)) is kernels.TORCH_BACKEND
    assert "cutedsl" in dispatch._BACKENDS
    assert not {"dion3_megatron.kernels.symm.kernel", "dion3_megatron.kernels.symm.launch"} & set(sys.modules)


def test_environment_variables_are_defaults_read_at_each_use(monkeypatch):
    monkeypatch.setenv("DION3_KERNELS", "0")
    assert kernels.current().kernels == "torch"
    assert not kernels.row_kernels_enabled()
    monkeypatch.setenv("DION3_KERNELS", "1")
    monkeypatch.setenv("DION3_FUSED_ROWS", "0")
    assert kernels.current() == kernels.KernelConfig(fused_rows=False)
    kernels.configure(fused_rows=True)  # an explicit setting wins over the environment
    monkeypatch.setenv("DION3_KERNELS", "0")
    assert kernels.current().kernels == "auto" and kernels.row_kernels_enabled()
    with kernels.using(kernels="torch"):  # and a block's over both
        assert kernels.current().kernels == "torch" and not kernels.row_kernels_enabled()
    assert kernels.current().kernels == "auto"


def test_an_optimizers_kernels_option_holds_for_its_steps_only(monkeypatch, generator):
    from dion3_megatron import Dion3

    seen = []
    monkeypatch.setattr(ortho, "get_backend", lambda x: seen.append(kernels.current().kernels) or kernels.TORCH_BACKEND)
    kernels.configure(kernels="auto")
    weight = torch.nn.Parameter(torch.randn(8, 12, generator=generator))
    opt = Dion3([weight], kernels="torch", cuda_graph=False)
    weight.grad = torch.randn(8, 12, generator=generator)
    opt.step()
    assert seen and set(seen) == {"torch"} and kernels.current().kernels == "auto"
    # A step that raises leaves no block open behind it.
    weight.grad = torch.randn(8, 12, generator=generator).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert kernels.current().kernels == "auto"


def test_the_kernels_option_reaches_the_row_kernels_and_the_graph_key(monkeypatch):
    from dion3_megatron.engine import cuda_graph
    from dion3_megatron.kernels import rows

    monkeypatch.setattr(rows, "_triton_installed", lambda: True)
    kernels.configure(kernels="auto")
    assert rows.available()
    with kernels.using(kernels="torch"):
        assert not rows.available()
    with kernels.using(fused_rows=False):
        assert not rows.available()
    # A configuration change makes the step graph start over (warm-up, then a new capture).
    graph = cuda_graph.StepGraph()
    monkeypatch.setattr(graph, "_on_side_stream", lambda fn: fn())
    monkeypatch.setattr(torch, "empty", lambda n, **_: torch.zeros(n))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: type("Stream", (), {"device": device})())
    ran = []
    graph.run("same key", ran.append, [1.0], torch.device("cpu"))
    assert graph.calls == 1
    with kernels.using(kernels="torch"):
        graph.run("same key", ran.append, [1.0], torch.device("cpu"))
    assert graph.calls == 1 and len(ran) == 2


@pytest.mark.parametrize("tile", kernels.config.TILES)
def test_tile_count_is_the_tiles_that_meet_the_lower_triangle(tile):
    """heuristics.tile_count, which sizes the kernels' grids and tile orders, against a count of every
    tile_m x tile_n tile that holds an element (r, c) with r >= c, odd counts of 128-row blocks too."""
    tile_m, tile_n = tile
    for m in (64, 128, 136, 1000, 1024, 1152, 2056, 2176):
        rows, cols = -(-m // tile_m), -(-m // tile_n)
        brute = sum(tile_n * j <= min(tile_m * i + tile_m, m) - 1 for i in range(rows) for j in range(cols))
        assert heuristics.tile_count(m, tile_m, tile_n) == brute, (m, tile)


SMS = 132  # an H200's


@pytest.fixture
def h200(monkeypatch):
    """The tile model at an H200's SM count and L2 cache (50 MiB), its cached picks made afresh."""
    monkeypatch.setattr(heuristics, "sm_count", lambda: SMS)
    monkeypatch.setattr(heuristics, "resident_clusters", lambda cluster_m: SMS // cluster_m)
    monkeypatch.setattr(heuristics, "l2_bytes", lambda: 50 * 2**20)
    heuristics.default_tile.cache_clear()
    yield
    heuristics.default_tile.cache_clear()


def test_stream_k_where_the_last_wave_would_leave_sms_idle(h200):
    """The automatic choice (heuristics.stream_k_pays and the tile model), at an H200's SM count:
    split where the tiles leave the last wave part empty, with a long enough share per CTA."""
    pays = heuristics.stream_k_pays
    assert pays(1, 2048, 2048, (128, 128))  # 136 tiles: a second wave of 4
    assert pays(1, 5120, 5120, (128, 128))  # 820: 7 waves 0.89 full
    assert not pays(1, 4096, 4096, (128, 128))  # 528: 4 whole waves
    assert not pays(1, 3456, 5120, (128, 128))  # 378: 0.95 full
    assert not pays(1, 3072, 12288, (128, 128))  # K above SPLIT_MAX_K
    assert not pays(16, 1024, 1024, (128, 128))  # a CTA's share of 22 K blocks
    assert not pays(1, 2048, 2048, (128, 256)) and not pays(1, 2048, 2048, (256, 256))
    assert heuristics.default_tile(2048, 1, 8192) == (128, 128)  # split: 1.03 waves, not 2
    assert heuristics.default_tile(2048, 1, 8192, split_allowed=False) == (64, 64)
    assert heuristics.default_tile(5120, 1, 5120) == (128, 128)


def test_the_256x128_cluster_where_an_operand_overflows_half_the_l2(h200):
    """The tile model at an H200's SM count and L2 (50 MiB): 256 x 128 (two 128 x 128 CTAs sharing
    B) for the K/V batch's products and the wide Gram, not where the operands fit in L2, and not
    where 128 x 128 fills whole waves or stream-K evens out the last one."""
    tile = heuristics.default_tile
    assert tile(1024, 16, 5120) == (256, 128) and tile(1024, 16, 1024) == (256, 128)
    assert tile(5120, 1, 13824) == (256, 128)
    assert tile(1024, 8, 1024) == (128, 128)  # 16 MiB operands: fits
    assert tile(4096, 1, 16384) == (128, 128)  # 4 whole waves
    assert tile(5120, 1, 5120) == (128, 128) and heuristics.stream_k_pays(1, 5120, 5120, (128, 128))
    assert not heuristics.stream_k_pays(16, 1024, 5120, (256, 128))  # clusters never split


@pytest.fixture
def capable(monkeypatch):
    """The kernel backend on CPU tensors as on a Hopper GPU: every operand capable, launches
    recorded instead of compiled (what a launch is decided from, not what it computes)."""
    decided = []
    monkeypatch.setattr(backend, "kernel_capable_device", lambda t: True)
    monkeypatch.setattr(backend, "_CHOICES", {})
    monkeypatch.setattr(backend, "_launch_for", lambda *key: decided.append(key) or ("launch", key))
    return decided


def test_each_kind_of_product_is_decided_once(capable, generator):
    """The backend decides a product's route once per kind (shape, strides, dtypes, device, kernel
    configuration): a launch on the operands as they lie, the general path, or torch."""
    kernels.configure(routing="measured")
    x = torch.randn(1, 2048, 8192, generator=generator).half()
    c = torch.randn(1, 2048, 2048, generator=generator).half()
    assert backend._choice(x, None) == ("launch", (1, 2048, 8192, torch.float16, torch.float16, None, False))
    assert backend._choice(x.clone(), None) is backend._choice(x, None) and len(capable) == 1  # cached
    assert backend._choice(c, c)[1][5] == torch.float16  # with an addend
    tall = torch.randn(1, 8192, 2048, generator=generator).half().mT  # a tall input's Gram: read in place
    assert backend._choice(tall, None)[1][-1] is True
    assert backend._choice(c, c.mT.contiguous().mT) == backend.GENERAL  # an addend laid out otherwise: copied
    assert backend._choice(c, c.float()) is None  # an addend of another dtype: torch
    small = torch.randn(1, 1024, 5120, generator=generator).half()
    assert backend._choice(small, None) is None  # 20 tiles: torch
    with kernels.using(routing="always"):  # a new configuration decides anew
        assert backend._choice(small, None)[0] == "launch"
    assert backend._choice(x.float(), None) is None  # fp32: no kernel


class _OnAHopper:
    """What kernel_capable_device reads of a tensor on GPU 0 (a Hopper, as the test makes it)."""

    is_cuda = True

    def get_device(self) -> int:
        return 0


@pytest.fixture
def on_a_hopper_with(monkeypatch):
    """Returns a function that makes these modules the importable ones and GPU 0 a Hopper; the
    cached answers are cleared before and after."""
    monkeypatch.setattr(backend, "_device_capable", lambda index: True)

    def importable(modules: set[str]) -> None:
        monkeypatch.setattr(backend, "_importable", lambda name: name in modules)
        backend.missing.cache_clear()
        backend._warn_half_installed.cache_clear()

    yield importable
    backend.missing.cache_clear()
    backend._warn_half_installed.cache_clear()


@pytest.mark.parametrize(
    "importable, missing",
    [({"cutlass.cute"}, "apache-tvm-ffi"), ({"tvm_ffi"}, "nvidia-cutlass-dsl")],
    ids=["without-tvm-ffi", "without-cutlass-dsl"],
)
def test_half_installed_kernels_stay_off_and_the_first_step_on_a_hopper_says_so_once(on_a_hopper_with, importable, missing):
    on_a_hopper_with(importable)
    with pytest.warns(RuntimeWarning) as warned:
        assert not backend.kernel_capable_device(_OnAHopper())
    [warning] = warned
    present = "nvidia-cutlass-dsl" if missing == "apache-tvm-ffi" else "apache-tvm-ffi"
    assert str(warning.message) == (
        f"dion3_megatron: the symmetric-GEMM kernels are off: {present} is installed but {missing} is not. Gram "
        "Newton-Schulz runs on cuBLAS, 1.45x the time it takes on the kernels (14B shapes, one H200). pip install "
        "'dion3-megatron[kernels]' installs what they need (DION3_KERNELS=0 runs torch without this warning)"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next steps are quiet
        assert backend.kernel_capable_device(_OnAHopper()) is False


@pytest.mark.parametrize("importable, capable", [({"cutlass.cute", "tvm_ffi"}, True), (set(), False)], ids=["installed", "not-installed"])
def test_kernels_installed_or_not_installed_at_all_step_without_a_warning(on_a_hopper_with, importable, capable):
    on_a_hopper_with(importable)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.kernel_capable_device(_OnAHopper()) is capable
        assert backend.kernels_installed() is capable


def test_half_installed_kernels_on_another_gpu_or_the_cpu_say_nothing(on_a_hopper_with, monkeypatch):
    on_a_hopper_with({"cutlass.cute"})
    monkeypatch.setattr(backend, "_device_capable", lambda index: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not backend.kernel_capable_device(_OnAHopper())
        assert not backend.kernel_capable_device(torch.empty(3))
