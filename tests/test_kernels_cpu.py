"""The kernels package on a machine without a GPU: it imports, and dispatch stays on torch."""

import pytest
import torch

from dion3_megatron import ortho


@pytest.fixture(autouse=True)
def _reset():
    yield
    ortho.set_backend("auto")
    from dion3_megatron.kernels import backend

    backend.set_routing("measured")


def test_package_imports_without_cutlass_side_effects():
    import dion3_megatron.kernels as kernels

    assert kernels.BACKEND_NAME == "cutedsl"
    assert ortho.get_backend(torch.zeros(1, 4, 8)).name == "torch"


def test_auto_dispatch_falls_back_to_torch_on_cpu():
    import dion3_megatron.kernels  # noqa: F401  (registers the selector)

    ortho.set_backend("auto")
    x = torch.randn(2, 64, 256)
    assert ortho.get_backend(x) is ortho.TORCH_BACKEND
    assert ortho.get_backend(x.half()) is ortho.TORCH_BACKEND


def test_override_by_name(generator):
    from dion3_megatron.kernels import backend

    ortho.set_backend("cutedsl")
    x = torch.randn(1, 32, 96, generator=generator)
    assert ortho.get_backend(x).name == "cutedsl"
    ortho.set_backend("torch")
    assert ortho.get_backend(x) is ortho.TORCH_BACKEND
    ortho.set_backend("auto")
    assert ortho.get_backend(x) is ortho.TORCH_BACKEND
    with pytest.raises(ValueError):
        ortho.set_backend("no-such-backend")
    with pytest.raises(ValueError):
        backend.set_routing("sometimes")


def test_forced_backend_on_cpu_computes_with_torch(generator):
    """Forcing the kernel backend on CPU operands runs every product in torch: same result."""
    from dion3_megatron.kernels import backend

    g = torch.randn(48, 160, generator=generator)
    ortho.set_backend("torch")
    ref = ortho.gram_newton_schulz(g, dtype=torch.float32)
    ortho.set_backend("cutedsl")
    backend.set_routing("always")
    out = ortho.gram_newton_schulz(g, dtype=torch.float32)
    assert torch.equal(out, ref)


def test_cpu_products_never_route_to_kernels(generator):
    from dion3_megatron.kernels import backend

    backend.set_routing("always")
    x = torch.randn(1, 64, 128, generator=generator).half()
    assert not backend.kernel_capable_device(x)
    r = backend.KERNEL_BACKEND.gram(x.float(), 1.0, 0.0, None)
    assert torch.allclose(r, x.float() @ x.float().mT)


def test_routing_rules():
    from dion3_megatron.kernels import backend

    backend.set_routing("measured")
    assert not backend.routes_to_kernel(1, 64, 64, torch.float16)  # tiny: cuBLAS
    assert not backend.routes_to_kernel(1, 8192, 8192, torch.float32)  # fp32: no kernel
    assert not backend.routes_to_kernel(1, 8190, 8192, torch.float16)  # unaligned rows
    backend.set_routing("always")
    assert backend.routes_to_kernel(1, 64, 64, torch.float16)
    assert not backend.routes_to_kernel(1, 64, 60, torch.float16)


def test_lazy_import_through_get_backend(monkeypatch):
    """ortho imports the kernels package on first CUDA operand; a CPU operand never needs it."""
    monkeypatch.setattr(ortho, "_AUTO_SELECTOR", None)
    monkeypatch.setattr(ortho, "_KERNELS_LOADED", False)
    assert ortho.get_backend(torch.zeros(1, 4, 8)) is ortho.TORCH_BACKEND
    assert ortho._KERNELS_LOADED is False
    ortho._load_kernels()
    assert ortho._KERNELS_LOADED is True
