"""Launching the symmetric GEMM: compiled kernels, one cached launch per kind of product, and
:func:`symm_gemm`.

Each kernel configuration is compiled once through CuTe DSL's TVM-FFI calling convention (the
``apache-tvm-ffi`` package): the compiled function takes plain Python ints and floats (device
addresses, sizes, scalars, the stream), so a launch costs a few microseconds of host time instead
of the tens that the DSL's generic argument marshalling takes. Everything a launch decides from
the product's shape, dtypes and the kernel configuration (tile, persistent or not, stream-K, the
compiled function) is decided once per kind of product and kept in a :class:`Launch`: an eager
call, outside any CUDA graph, then does little more than read its operands' addresses.

This module imports cutlass (through :mod:`.kernel`): import it only where nvidia-cutlass-dsl is
installed (:mod:`.backend` does that lazily).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_ptr

from .. import config as kernel_config
from ..dispatch import transposed_view
from . import heuristics
from .kernel import SymmGemmSm90, max_stages, staging_bytes

_TORCH_TO_CUTLASS = {
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.float32: cutlass.Float32,
}
COMPILE_OPTIONS = "--gpu-arch sm_90a --enable-tvm-ffi"
_COMPILED: dict = {}  # kernel configuration -> its TVM-FFI function
_LAUNCHES: dict = {}  # (kind of product, what the caller asked for, kernel configuration) -> Launch
_WORKSPACES: dict = {}  # (device, stream) -> stream-K's partial sums and flags


def compile_kernel(kernel: SymmGemmSm90) -> Any:
    """``cute.compile`` of one configuration for sm_90a, callable through TVM-FFI. The pointers,
    sizes, scalars and stream are the launch's arguments, so stand-ins serve here, and no GPU is
    needed: a machine with nvidia-cutlass-dsl and no GPU compiles it too
    (tests/unit/test_kernels_compile.py)."""
    from cutlass.runtime import make_fake_stream

    def dummy(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(
        kernel,
        dummy(kernel.ab_dtype),
        dummy(kernel.ab_dtype),
        dummy(kernel.c_dtype or kernel.d_dtype),
        dummy(kernel.d_dtype),
        dummy(Float32),
        dummy(Int32),
        8,
        8,
        1,
        Float32(1.0),
        Float32(0.0),
        make_fake_stream(),
        options=COMPILE_OPTIONS,
    )


def _ffi_function(compiled: Any) -> Callable:
    """The positional TVM-FFI function of a compiled kernel (the DSL's keyword wrapper left out)."""
    raw = getattr(compiled, "__tvm_ffi_object__", None)
    function = raw() if raw is not None else compiled
    if function is None:
        raise RuntimeError("the compiled symmetric-GEMM kernel has no TVM-FFI function on this machine (compiled without a CUDA driver?)")
    return function


def compiled(
    ab: torch.dtype,
    d: torch.dtype,
    c: Optional[torch.dtype],
    tile,
    stages: Optional[int] = None,
    m_major: bool = False,
    ctas_per_sm: Optional[int] = None,
    persistent: bool = False,
    tile_group: int = kernel_config.DEFAULT_TILE_GROUP,
    stream_k: bool = False,
) -> Callable:
    """The launchable function of one configuration (compiled on first use, then cached);
    ctas_per_sm None: the tile's default (:data:`.heuristics.DEFAULT_CTAS_PER_SM`); persistent: a
    grid of the CTAs that stay resident (:func:`.heuristics.persistent_ctas`), each walking tiles;
    tile_group: the tile order's band; stream_k: the persistent launch splits its last waves' tiles
    along K (see :class:`.kernel.SymmGemmSm90`). Called as ``f(a, b, c, d, workspace, flags, m, k,
    batch, alpha, beta, stream)`` with device addresses as ints."""
    shape = kernel_config.tile_shape(tile)
    ctas_per_sm = heuristics.checked_ctas_per_sm(*shape, ctas_per_sm)
    beside = staging_bytes(*shape, d.itemsize, persistent) if persistent else 0
    stages = stages or max_stages(*shape, ctas_per_sm=ctas_per_sm, beside_ring=beside)
    grid = heuristics.persistent_ctas(shape, ctas_per_sm) if persistent else None
    key = (ab, d, c, shape, stages, m_major, ctas_per_sm, grid, tile_group, stream_k)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = _ffi_function(
            compile_kernel(
                SymmGemmSm90(
                    _TORCH_TO_CUTLASS[ab],
                    _TORCH_TO_CUTLASS[d],
                    _TORCH_TO_CUTLASS[c] if c is not None else None,
                    shape,
                    stages,
                    m_major,
                    ctas_per_sm,
                    grid,
                    tile_group,
                    stream_k,
                )
            )
        )
    return fn


def split_workspace(ctas: int, tile_elems: int, device: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stream-K's workspace on ``device`` for ``stream`` (its handle): a float32 tile of partial
    sums per CTA, and an int32 flag per CTA, zero between launches (each launch lowers the flags it
    raised). One per stream, since the launches on a stream run one after another; first made on a
    stream that a CUDA graph captures, its zeroing is captured too (harmless: the flags are zero then)."""
    ws = _WORKSPACES.get((device, stream))
    if ws is None or ws[0].numel() < ctas * tile_elems or ws[1].numel() < ctas:
        ws = _WORKSPACES[device, stream] = (
            torch.empty(ctas * tile_elems, dtype=torch.float32, device=device),
            torch.zeros(ctas, dtype=torch.int32, device=device),
        )
    return ws


def _current_stream(device: int) -> int:
    """The handle of ``device``'s current stream (torch's own accessor: a tenth of the host time of
    ``torch.cuda.current_stream(device).cuda_stream``)."""
    return torch._C._cuda_getCurrentRawStream(device)


@dataclass(frozen=True)
class Launch:
    """One kind of product, decided: its launch (:class:`.heuristics.LaunchChoice`) and compiled
    function; ``split_ctas`` and ``split_tile_elems`` size stream-K's workspace (0 without it)."""

    choice: heuristics.LaunchChoice
    function: Callable
    split_ctas: int
    split_tile_elems: int

    def __call__(self, a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], out: torch.Tensor, alpha: float, beta: float) -> None:
        batch, m, k = a.shape
        device = out.get_device()
        stream = _current_stream(device)
        workspace = flags = out  # stand-ins unless stream-K
        if self.split_ctas:
            workspace, flags = split_workspace(self.split_ctas, self.split_tile_elems, device, stream)
        self.function(
            a.data_ptr(),
            b.data_ptr(),
            (out if c is None else c).data_ptr(),
            out.data_ptr(),
            workspace.data_ptr(),
            flags.data_ptr(),
            m,
            k,
            batch,
            float(alpha),
            float(beta),
            stream,
        )


def launch_for(
    batch: int,
    m: int,
    k: int,
    ab: torch.dtype,
    out: torch.dtype,
    c: Optional[torch.dtype],
    m_major: bool,
    tile=None,
    stages: Optional[int] = None,
    ctas_per_sm: Optional[int] = None,
    persistent: Optional[bool] = None,
    stream_k: Optional[bool] = None,
) -> Launch:
    """The :class:`Launch` of a product (decided and compiled on first use, then cached)."""
    config = kernel_config.current()
    key = (batch, m, k, ab, out, c, m_major, tile, stages, ctas_per_sm, persistent, stream_k, config)
    launch = _LAUNCHES.get(key)
    if launch is None:
        choice = heuristics.choose_launch(
            batch, m, k, out == torch.float32, c is not None and c != out, config, tile, persistent, stream_k, ctas_per_sm
        )
        function = compiled(
            ab,
            out,
            c,
            choice.tile,
            stages,
            m_major,
            choice.ctas_per_sm,
            choice.persistent,
            tile_group=config.tile_group,
            stream_k=choice.stream_k,
        )
        split_ctas = heuristics.persistent_ctas(choice.tile, choice.ctas_per_sm) if choice.stream_k else 0
        launch = _LAUNCHES[key] = Launch(choice, function, split_ctas, choice.tile[0] * choice.tile[1])
    return launch


def symm_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    tile=None,
    stages: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    ctas_per_sm: Optional[int] = None,
    persistent: Optional[bool] = None,
    stream_k: Optional[bool] = None,
) -> torch.Tensor:
    """D = alpha * a @ b^T + beta * c for a, b (L, M, K) fp16/bf16 with a @ b^T symmetric.

    a is b for a Gram product; for a product P @ Q of commuting symmetric matrices pass b = Q
    (Q^T = Q). Only the lower triangle of tiles is computed; the upper is its mirror.
    c (L, M, M) must be symmetric. K must be a multiple of 8 (16-byte rows for TMA). a and b are
    read in place when both are contiguous or both transposed views of contiguous (L, K, M)
    tensors (then M must be a multiple of 8 too), else copied K-major first.
    tile: one of :data:`..config.TILES`, as 64, 128, 256, (128, 256) or "128x256" (default: the kernel
    configuration's tile, else :func:`.heuristics.default_tile`). ctas_per_sm: CTAs kept resident per
    SM (:data:`.heuristics.CTAS_PER_SM` lists what each tile allows; the pipeline gets shallower to
    fit). persistent: one CTA per SM walking the tiles, the stores by warps that do no MMAs
    (default: the kernel configuration's ``persistent``, and where that is None,
    :func:`.heuristics.persistent_pays`); it stages the tile, and C, in the output dtype, so a
    float32 ``out`` (twice the shared memory), or a C of another dtype than ``out``'s, always runs
    one CTA per tile. stream_k: the persistent launch, its last waves' tiles split along K among
    all its CTAs (single-CTA tiles: not the clusters 256 x 256 and 256 x 128; the fp32 sums of a
    split tile's parts are added in a fixed order, so the result is the same in every launch,
    within a rounding of the unsplit one); default: the kernel configuration's ``stream_k`` (True:
    where the launch can take it), and where that is None, :func:`.heuristics.stream_k_pays`
    unless the launch was made one CTA per tile.
    Returns (L, M, M) in out_dtype (default a's dtype), or writes ``out``.
    """
    same = b is a  # before unsqueeze makes two views of one tensor
    squeeze = a.dim() == 2
    if squeeze:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
        c = c.unsqueeze(0) if c is not None and c.dim() == 2 else c
        out = out.unsqueeze(0) if out is not None else None
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise TypeError(f"symm_gemm takes fp16/bf16 operands of one dtype, got {a.dtype}, {b.dtype}")
    if a.shape != b.shape or a.dim() != 3:
        raise ValueError(f"a and b must be (L, M, K) of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    batch, m, k = a.shape
    if k % 8:
        raise ValueError(f"K must be a multiple of 8, got {k}")
    # Operands are read as they lie when both are K-major, or both M-major (a tall input's Gram: the
    # transposed view of a row-major matrix); anything else is made K-major first (a copy of a
    # 13824x5120 operand costs ~0.46 ms on an H200, 5% of the whole Gram NS), once for a Gram product.
    m_major = m % 8 == 0 and transposed_view(a) and transposed_view(b)  # TMA: 16-byte strides
    if not m_major:
        a = a.contiguous()
        b = a if same else b.contiguous()
    if out is None:
        out = torch.empty(batch, m, m, dtype=out_dtype or a.dtype, device=a.device)
    elif out.shape != (batch, m, m) or not out.is_contiguous():
        raise ValueError("out must be a contiguous (L, M, M) tensor")
    c = c.expand(batch, m, m).contiguous() if c is not None and beta != 0.0 else None  # beta 0: C unread
    launch = launch_for(
        batch, m, k, a.dtype, out.dtype, c.dtype if c is not None else None, m_major, tile, stages, ctas_per_sm, persistent, stream_k
    )
    launch(a, b, c, out, alpha, beta)
    return out.squeeze(0) if squeeze else out
