"""CuTe DSL symmetric-GEMM kernels against float64 references (GPU only).

Every test is marked ``gpu`` and skipped without CUDA, without a Hopper (sm_90) device, or
without nvidia-cutlass-dsl. Inputs are fresh random draws each run; outputs are poisoned with
NaN before the kernel runs so an element the kernel never wrote fails the check.
"""

import pytest
import torch

from dion3_megatron import kernels
from dion3_megatron.core import ortho
from dion3_megatron.kernels.symm import backend

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}


def _skip_unless_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("kernels need a Hopper (sm_90) GPU")
    if not backend.kernels_installed():
        pytest.skip("needs nvidia-cutlass-dsl")


@pytest.fixture(autouse=True)
def _kernels_and_clean_state():
    _skip_unless_kernels()
    yield
    kernels.configure(None)


def _rel(out, ref):
    out = out.double()
    assert torch.isfinite(out).all(), "non-finite output (an element left unwritten?)"
    return ((out - ref).norm() / ref.norm()).item()


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to("cuda", dtype)


@pytest.fixture
def cuda_gen():
    seed = torch.seed() % (2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


# batch, m, k: tile multiples, non-multiples (M and K multiples of 8 only), batched, tiny
SHAPES = [(1, 256, 512), (1, 1000, 3000), (3, 520, 1032), (2, 136, 72), (1, 72, 4096), (2, 1288, 640)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tile", [64, 128, "128x256", "256x128", "256x256"])
def test_gram_vs_fp64(cuda_gen, dtype, shape, tile):
    from dion3_megatron.kernels.symm.launch import symm_gemm

    b, m, k = shape
    x = _rand(cuda_gen, b, m, k, dtype=dtype) / k**0.25
    out = _poisoned((b, m, m), dtype)
    symm_gemm(x, x, 1.0, 0.0, None, out=out, tile=tile)
    xd = x.double()
    ref = xd @ xd.mT
    assert _rel(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 256, 512), (1, 1000, 3000), (3, 520, 1032), (2, 136, 72), (2, 1288, 640)])
@pytest.mark.parametrize("tile", [64, 128, "128x256", "256x128", "256x256"])
def test_gram_of_a_transposed_operand_reads_it_in_place(cuda_gen, dtype, shape, tile, monkeypatch):
    """The tall input's Gram: X^T X of a row-major (L, K, M) X, passed as the (L, M, K) view X^T,
    runs on the M-major kernel without a copy, with + beta * C."""
    from dion3_megatron.kernels.symm import launch as sm90_symm

    b, m, k = shape
    xt = (_rand(cuda_gen, b, k, m, dtype=dtype) / k**0.25).mT
    c = _rand(cuda_gen, b, m, m, dtype=torch.float32)
    c = c + c.mT
    copied = []
    contiguous = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **kw: copied.append(t.shape) or contiguous(t, *a, **kw))
    out = _poisoned((b, m, m), torch.float32)
    sm90_symm.symm_gemm(xt, xt, 0.5, -2.0, c, out=out, tile=tile)
    assert torch.Size((b, m, k)) not in copied, copied
    xd = xt.double()
    assert _rel(out, 0.5 * xd @ xd.mT - 2.0 * c.double()) <= TOL[dtype]
    assert torch.equal(out, out.mT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, None])
@pytest.mark.parametrize("shape", [(1, 1000, 3000), (3, 520, 1032)])
@pytest.mark.parametrize("tile", [None, "128x256", "256x128", "256x256"])
def test_gram_alpha_beta_c(cuda_gen, dtype, out_dtype, shape, tile):
    from dion3_megatron.kernels.symm.launch import symm_gemm

    b, m, k = shape
    x = _rand(cuda_gen, b, m, k, dtype=dtype) / k**0.25
    c0 = _rand(cuda_gen, b, m, m, dtype=torch.float64)
    c = (c0 + c0.mT).to(dtype)  # symmetric
    od = out_dtype or dtype
    out = _poisoned((b, m, m), od)
    alpha, beta = -0.75, 1.5
    symm_gemm(x, x, alpha, beta, c, out=out, tile=tile)
    xd = x.double()
    ref = alpha * (xd @ xd.mT) + beta * c.double()
    assert _rel(out, ref) <= TOL[dtype]
    assert torch.equal(out, out.mT), "mirrored result must be exactly symmetric"


@pytest.mark.parametrize("ctas_per_sm", [2, 3, 4])
@pytest.mark.parametrize("m_major", [False, True])
def test_several_ctas_per_sm_change_nothing_but_residency(cuda_gen, ctas_per_sm, m_major):
    # A shallower pipeline, the same k order: bit for bit the result of one CTA per SM.
    from dion3_megatron.kernels.symm.launch import symm_gemm

    b, m, k = 3, 520, 1032
    if m_major:  # the transposed view of a row-major (b, k, m): read in place
        x = (_rand(cuda_gen, b, k, m, dtype=torch.float16) / k**0.25).mT
    else:
        x = _rand(cuda_gen, b, m, k, dtype=torch.float16) / k**0.25
    c0 = _rand(cuda_gen, b, m, m, dtype=torch.float64)
    c = (c0 + c0.mT).to(torch.float16)
    outs = [_poisoned((b, m, m), torch.float16) for _ in range(2)]
    symm_gemm(x, x, -0.75, 1.5, c, out=outs[0], tile=64, ctas_per_sm=1)
    symm_gemm(x, x, -0.75, 1.5, c, out=outs[1], tile=64, ctas_per_sm=ctas_per_sm)
    xd = x.double()
    assert _rel(outs[1], -0.75 * (xd @ xd.mT) + 1.5 * c.double()) <= TOL[torch.float16]
    assert torch.equal(outs[0], outs[1])


def _launch_operands(gen, operands, b, m, k, dtype):
    """(x, y, c, alpha, beta) of a launch test: a Gram product; the Gram of a transposed view with
    an addend; or a product of two commuting symmetric m x m matrices with an addend."""
    if operands == "symmetric product, + beta C":
        x, y = _commuting_pair(gen, b, m, dtype)
        return x, y, x, 1.25, -0.5
    if operands == "gram":
        x = _rand(gen, b, m, k, dtype=dtype) / k**0.25
        return x, x, None, 1.0, 0.0
    x = (_rand(gen, b, k, m, dtype=dtype) / k**0.25).mT
    c0 = _rand(gen, b, m, m, dtype=torch.float64)
    return x, x, (c0 + c0.mT).to(dtype), -0.75, 1.5


def _check_gram(out, x, c, alpha, beta, dtype):
    xd = x.double()
    ref = alpha * xd @ xd.mT + (beta * c.double() if c is not None else 0.0)
    assert _rel(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("tile", [64, 128, "128x256", "256x128", "256x256"])
@pytest.mark.parametrize("operands", ["gram", "gram of a transposed view, + beta C", "symmetric product, + beta C"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_persistent_launch_against_one_cta_per_tile(cuda_gen, tile, operands, dtype):
    """More tiles than resident CTAs, so each CTA walks several and its idle warps store one tile
    while its consumers compute the next: the per-tile launch's result (bit for bit without C;
    with C, which the consumers add in registers, within a rounding of it), exactly symmetric."""
    from dion3_megatron.kernels.symm.launch import symm_gemm

    b, m, k = 4, 2056, 520  # 324 tiles of 128 x 256 per launch against 132 SMs; K not a tile multiple
    x, y, c, alpha, beta = _launch_operands(cuda_gen, operands, b, m, k, dtype)
    outs = [_poisoned((b, m, m), dtype) for _ in range(2)]
    for out, persistent in zip(outs, (False, True)):
        symm_gemm(x, y, alpha, beta, c, out=out, tile=tile, persistent=persistent)
    assert torch.isfinite(outs[1]).all(), "an element the persistent launch never wrote"
    assert torch.equal(outs[1], outs[1].mT)
    if c is None:
        assert torch.equal(outs[0], outs[1])
    else:  # alpha * acc + beta * C may round once differently (fused or not)
        ulp = torch.finfo(dtype).eps * outs[0].double().abs().clamp_min(1.0)
        assert ((outs[1].double() - outs[0].double()).abs() <= ulp).all()
    if operands != "symmetric product, + beta C":
        _check_gram(outs[1], x, c, alpha, beta, dtype)


# (batch, m, k) at 128 x 128 tiles against 132 SMs: 10 tiles of 64 K blocks (each split in about
# 13 parts); 136 tiles (all split, in two parts at most); 612 tiles (3 whole waves, then the split
# ones), K not a multiple of the 64-wide K block; 3 x 36 tiles of a 1000-wide result
STREAM_K_SHAPES = [(1, 512, 4096), (1, 2048, 2048), (4, 2056, 520), (3, 1000, 1032)]


@pytest.mark.parametrize("tile", [64, 128, "128x256"])
@pytest.mark.parametrize("shape", STREAM_K_SHAPES)
@pytest.mark.parametrize("operands", ["gram", "gram of a transposed view, + beta C", "symmetric product, + beta C"])
def test_stream_k_against_one_cta_per_tile(cuda_gen, tile, shape, operands):
    """The persistent launch with the last waves' tiles split along K: every element written,
    exactly symmetric, within a rounding of the per-tile launch (a split tile's parts are summed
    in another order), and the same bit for bit in a second launch (the parts are added in a
    fixed order, and each launch leaves the flags down for the next)."""
    from dion3_megatron.kernels.symm.launch import symm_gemm

    dtype = torch.float16
    b, m, k = shape
    x, y, c, alpha, beta = _launch_operands(cuda_gen, operands, b, m, k, dtype)
    outs = [_poisoned((b, m, m), dtype) for _ in range(3)]
    for out, stream_k in zip(outs, (False, True, True)):
        symm_gemm(x, y, alpha, beta, c, out=out, tile=tile, persistent=stream_k, stream_k=stream_k)
    assert torch.isfinite(outs[1]).all(), "an element the stream-K launch never wrote"
    assert torch.equal(outs[1], outs[1].mT)
    assert torch.equal(outs[2], outs[1])
    ulp = torch.finfo(dtype).eps * outs[0].double().abs().clamp_min(1.0)
    assert ((outs[1].double() - outs[0].double()).abs() <= ulp).all()
    if operands != "symmetric product, + beta C":
        _check_gram(outs[1], x, c, alpha, beta, dtype)


def test_stream_k_where_the_launch_cannot_take_it_is_refused():
    from dion3_megatron.kernels.symm.launch import symm_gemm

    x = torch.randn(512, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="stream_k needs the persistent launch of a single-CTA tile"):
        symm_gemm(x, x, tile="256x256", persistent=True, stream_k=True)
    with pytest.raises(ValueError, match="stream_k needs the persistent launch of a single-CTA tile"):
        symm_gemm(x, x, tile=128, persistent=False, stream_k=True)


@pytest.mark.parametrize("tile", [64, 128, "128x256", "256x128", "256x256"])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_banded_tile_order_changes_nothing_but_the_order(cuda_gen, tile, persistent):
    """KernelConfig.tile_group reorders the tiles (bands of block rows, a last band shorter, with
    an odd count of 128-row blocks the half row last): every tile is computed once, as in the
    row-by-row order, so the result is the same bit for bit, with C too (without stream-K, whose
    split points, and so its roundings, move with the order)."""
    from dion3_megatron.kernels.symm.launch import symm_gemm

    b, m = 2, 2056  # 17 row blocks of 128: bands of 3 leave short ones at every tile
    x, y = _commuting_pair(cuda_gen, b, m, torch.float16)
    outs = []
    for group in (1, 3, 8):
        out = _poisoned((b, m, m), torch.float16)
        with kernels.using(tile_group=group):
            symm_gemm(x, y, 1.25, -0.5, x, out=out, tile=tile, persistent=persistent, stream_k=False)
        outs.append(out)
    assert torch.isfinite(outs[0]).all(), "an element the row-by-row order never wrote"
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


def test_persistent_launch_from_the_kernel_configuration(cuda_gen, monkeypatch):
    """KernelConfig(persistent=True) reaches the launch: Gram NS under it runs the persistent
    kernel and orthogonalizes as the per-tile launch does."""
    from dion3_megatron.kernels.symm import launch as sm90_symm

    launches = []  # the persistent flag of each launch decided (the cache emptied: every one is)
    compiled = sm90_symm.compiled
    monkeypatch.setattr(sm90_symm, "_LAUNCHES", {})
    monkeypatch.setattr(sm90_symm, "compiled", lambda *a, **kw: launches.append(a[-1]) or compiled(*a, **kw))
    x = _rand(cuda_gen, 2, 1032, 3096, dtype=torch.float32)
    with kernels.using(routing="always", persistent=False):
        ref = ortho.orthogonalize(x, "gram", torch.float16)
    assert launches and not any(launches)
    launches.clear()
    with kernels.using(routing="always", persistent=True):
        got = ortho.orthogonalize(x, "gram", torch.float16)
    assert launches and all(launches)
    assert _rel(got, ref.double()) <= 1e-2


def test_the_default_launch_is_persistent_from_two_waves(cuda_gen, monkeypatch):
    """KernelConfig(persistent=None), the default: one CTA per tile where the tiles take less
    than two waves, the persistent launch from two on, with C as without, at any K."""
    from dion3_megatron.kernels.symm import heuristics, launch as sm90_symm

    launches = []  # the persistent flag of each launch decided (the cache emptied: every one is)
    compiled = sm90_symm.compiled
    monkeypatch.setattr(sm90_symm, "_LAUNCHES", {})
    monkeypatch.setattr(sm90_symm, "compiled", lambda *a, **kw: launches.append(a[-1]) or compiled(*a, **kw))
    for batch, m in ((1, 512), (8, 4096)):
        x = _rand(cuda_gen, batch, m, 256, dtype=torch.float16)
        out = sm90_symm.symm_gemm(x, x)
        assert launches[-1] == heuristics.persistent_pays(batch, m, heuristics.default_tile(m, batch, 256))
        xd = x.double()
        assert _rel(out, xd @ xd.mT) <= TOL[torch.float16]
    assert launches == [False, True]  # 1 tile of 512^2; 8 x 136 tiles of 4096^2 at 256 x 256 (or more)
    for k in (1024, 2048):  # a symmetric product's shape, with C: persistent at a short K too
        x = _rand(cuda_gen, 8, 4096, k, dtype=torch.float16)
        c = _rand(cuda_gen, 8, 4096, 4096, dtype=torch.float16)
        sm90_symm.symm_gemm(x, x, 1.0, 0.5, c + c.mT)
    assert launches[-2:] == [True, True]


def test_ctas_per_sm_a_tile_cannot_hold_is_refused():
    from dion3_megatron.kernels.symm.launch import symm_gemm

    x = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="ctas_per_sm at tile 128x256 must be one of"):
        symm_gemm(x, x, tile="128x256", ctas_per_sm=2)


def _commuting_pair(gen, b, m, dtype):
    s = torch.randn(b, m, m, generator=gen, dtype=torch.float64)
    s = (s + s.mT) / (2 * m) ** 0.5
    p = 0.5 * s + 0.25 * s @ s
    q = -0.3 * s + 0.2 * s @ s @ s
    return p.to("cuda", dtype), q.to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 512), (1, 1000), (4, 264), (2, 1288)])
@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("tile", [None, "128x256", "256x128", "256x256"])
def test_symmetric_product_vs_fp64(cuda_gen, dtype, shape, with_c, tile):
    from dion3_megatron.kernels.symm.launch import symm_gemm

    b, m = shape
    p, q = _commuting_pair(cuda_gen, b, m, dtype)
    out = _poisoned((b, m, m), dtype)
    alpha, beta = 1.25, -0.5
    symm_gemm(p, q, alpha, beta if with_c else 0.0, p if with_c else None, out=out, tile=tile)
    full = p.double() @ q.double()
    # The kernel computes the lower triangle of P Q and mirrors it (P, Q commute up to rounding).
    lower = torch.tril(full)
    ref = alpha * (lower + torch.tril(full, -1).mT)
    if with_c:
        ref = ref + beta * p.double()
    assert _rel(out, ref) <= TOL[dtype]
    # and against the exact product of the commuting pair (rounding of P and Q included)
    exact = alpha * full + (beta * p.double() if with_c else 0.0)
    assert _rel(out, exact) <= TOL[dtype]
    assert torch.equal(out, out.mT), "mirrored result must be exactly symmetric"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backend_products_vs_fp64(cuda_gen, dtype):
    """The registered backend's gram/symmetric (forced onto the kernels) against fp64."""
    kernels.configure(routing="always")
    be = backend.KERNEL_BACKEND
    x = _rand(cuda_gen, 2, 384, 1536, dtype=dtype) / 1536**0.25
    r = be.gram(x, 1.0, 0.0, None)
    xd = x.double()
    assert _rel(r, xd @ xd.mT) <= TOL[dtype]
    z = be.symmetric(r, r, 0.5, -1.0, r)
    rd = r.double()
    assert _rel(z, 0.5 * rd @ rd - rd) <= TOL[dtype]
    # a transposed (column-major) operand: read in place (M-major)
    xt = _rand(cuda_gen, 1, 1536, 384, dtype=dtype).mT
    g = be.gram(xt, 1.0, 0.0, None)
    assert _rel(g, xt.double() @ xt.double().mT) <= TOL[dtype]


@pytest.mark.parametrize("shape", [(1024, 3072), (3072, 1024), (4, 520, 1560), (2048, 2048), (6144, 12288)])
def test_gram_newton_schulz_kernels_vs_torch(cuda_gen, shape):
    """Gram NS on the kernels vs Gram NS in torch: same function up to rounding."""
    g = torch.randn(*shape, generator=cuda_gen).cuda()
    ref = ortho.gram_newton_schulz(g.double(), dtype=torch.float64)
    with kernels.using(kernels="torch"):
        torch_out = ortho.gram_newton_schulz(g)
    kernels.configure(backend=backend.BACKEND_NAME, routing="always")
    kern_out = ortho.gram_newton_schulz(g)
    assert torch.isfinite(kern_out).all()
    err_torch = _rel(torch_out, ref)
    err_kern = _rel(kern_out, ref)
    diff = _rel(kern_out, torch_out.double())
    print(f"err torch {err_torch:.3e} kernels {err_kern:.3e} diff {diff:.3e}")
    assert err_kern <= 1.5 * err_torch + 2e-3
    assert diff <= 2e-2


def test_auto_dispatch_claims_cuda_operands():
    kernels.configure(kernels="auto")
    x = torch.empty(1, 4096, 8192, device="cuda", dtype=torch.float16)
    assert ortho.get_backend(x).name == backend.BACKEND_NAME
    assert ortho.get_backend(x[:, :1024]).name == "torch"  # too small to pay
    assert ortho.get_backend(x.cpu()).name == "torch"
    kernels.configure(kernels="torch")
    assert ortho.get_backend(x).name == "torch"
