"""CuTe DSL symmetric GEMM for Hopper (sm_90a): D = alpha * A @ B^T + beta * C, one triangle.

Both products of Gram Newton-Schulz have this form with K-major operands:
  * gram       D = alpha * X X^T + beta * C      A = B = X (s x L, row-major)
  * symmetric  D = alpha * P Q + beta * C        P, Q symmetric and commuting (s x s, row-major):
                                                 Q^T = Q, so Q's row-major storage is the K-major
                                                 "B" operand, and P Q is symmetric.
The kernel computes only the tiles (i, j) with i >= j of the square output, and writes every
off-diagonal tile twice: as itself and, transposed, as tile (j, i). A diagonal tile is computed
once and written from its lower triangle (mirrored), so every element is stored exactly once. beta * C is read from the lower-triangle tiles only (C must be symmetric, as every addend
of Gram NS is) and mirrored with the product, so D is always exactly symmetric.

Structure (one CTA per lower-triangle tile, batched over grid z):
  * warpgroup 0, warp 0: TMA producer (bulk tensor copies of A and B k-slices into a multi-stage
    shared-memory ring, completion on mbarriers);
  * warpgroups 1..n: wgmma consumers, fp32 accumulators in registers (64 rows per warpgroup);
  * epilogue: alpha * accumulators + beta * C (in registers, fp32) -> padded fp32 shared tile
    -> coalesced global stores of the tile and of its transpose.

This module imports cutlass at the top: import it only where nvidia-cutlass-dsl is installed
(``dion3_megatron.kernels`` does that lazily).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

TILE_K = 64


SMEM_BYTES = 227 * 1024  # usable dynamic shared memory per block on sm_90


def max_stages(tile: int, ab_bytes: int = 2) -> int:
    """Pipeline depth that fits next to the fp32 epilogue tile."""
    stage = 2 * tile * TILE_K * ab_bytes
    epi = tile * (tile + 1) * 4
    return max(2, min(8, (SMEM_BYTES - epi - 2048) // stage))


class SymmGemmSm90:
    """One compiled configuration: square output tile ``tile`` (64 or 128), pipeline ``stages``,
    operand dtype ``ab``, output dtype ``d``, addend dtype ``c`` (None: no beta * C term)."""

    def __init__(self, ab, d, c=None, tile: int = 128, stages: Optional[int] = None):
        if tile not in (64, 128):
            raise ValueError(f"tile must be 64 or 128, got {tile}")
        self.ab_dtype, self.d_dtype, self.c_dtype = ab, d, c
        self.tile = tile
        self.stages = stages or max_stages(tile)
        if self.stages > max_stages(tile):
            raise ValueError(f"{self.stages} stages do not fit in shared memory at tile {tile}")
        self.has_c = c is not None
        self.n_mma_wg = tile // 64
        self.mma_threads = 128 * self.n_mma_wg
        self.threads = 128 + self.mma_threads
        self.pad = 1  # odd fp32 pitch: conflict-free column reads of the shared tile

    # ---------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,  # (L, M, K) row-major
        pB: cute.Pointer,  # (L, M, K) row-major
        pC: cute.Pointer,  # (L, M, M) row-major (ignored unless has_c)
        pD: cute.Pointer,  # (L, M, M) row-major
        m: Int32,
        k: Int32,
        batch: Int32,
        alpha: Float32,
        beta: Float32,
        stream,
    ):
        ab_dtype = self.ab_dtype
        tile = self.tile
        k8 = cute.assume(k, divby=8)
        ld = cutlass.Int64(k8)
        mA = cute.make_tensor(pA, cute.make_layout((m, k8, batch), stride=(ld, 1, ld * m)))
        mB = cute.make_tensor(pB, cute.make_layout((m, k8, batch), stride=(ld, 1, ld * m)))
        ldd = cutlass.Int64(m)
        mD = cute.make_tensor(pD, cute.make_layout((m, m, batch), stride=(ldd, 1, ldd * m)))
        mC = mD
        if const_expr(self.has_c):
            mC = cute.make_tensor(pC, cute.make_layout((m, m, batch), stride=(ldd, 1, ldd * m)))

        tile_mnk = (tile, tile, TILE_K)
        tiled_mma = sm90.make_trivial_tiled_mma(
            ab_dtype,
            ab_dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            (self.n_mma_wg, 1, 1),
            tiler_mn=(64, tile),
        )
        a_layout = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, ab_dtype, self.stages)
        b_layout = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, ab_dtype, self.stages)
        tma_a, tA = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(a_layout, (None, None, 0)), (tile, TILE_K)
        )
        tma_b, tB = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_layout, (None, None, 0)), (tile, TILE_K)
        )
        d_pitch = tile + self.pad

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(b_layout)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, tile * d_pitch], 128]

        self.storage = Storage
        n_tiles = (m + tile - 1) // tile
        grid = (n_tiles * (n_tiles + 1) // 2, 1, batch)
        self.kernel(tma_a, tA, tma_b, tB, mC, mD, alpha, beta, tiled_mma, a_layout, b_layout).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream
        )

    # ---------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mD: cute.Tensor,
        alpha: Float32,
        beta: Float32,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
    ):
        tile = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, bidz = cute.arch.block_idx()

        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        # Lower-triangle tile (ti, tj), ti >= tj, from the linear block index t = ti(ti+1)/2 + tj.
        t = Int32(bidx)
        ti = Int32((cute.math.sqrt(Float32(8 * t + 1)) - Float32(1.0)) * Float32(0.5))
        if (ti + 1) * (ti + 2) // 2 <= t:
            ti = ti + 1
        if ti * (ti + 1) // 2 > t:
            ti = ti - 1
        tj = t - ti * (ti + 1) // 2

        smem = SmemAllocator()
        st = smem.allocate(self.storage)
        sA = st.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = st.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        sD = st.sD.get_tensor(cute.make_layout((tile, tile), stride=(tile + self.pad, 1)))

        a_stage = cute.slice_(a_layout, (None, None, 0))
        b_stage = cute.slice_(b_layout, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.ab_dtype, a_stage) + cute.size_in_bytes(self.ab_dtype, b_stage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.n_mma_wg * 4),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        tile_mnk = (tile, tile, TILE_K)
        gA = cute.local_tile(mA, tile_mnk, (ti, tj, None, bidz), proj=(1, None, 1))  # (T, BK, kt)
        gB = cute.local_tile(mB, tile_mnk, (ti, tj, None, bidz), proj=(None, 1, 1))  # (T, BK, kt)
        k_tiles = cute.size(gA, mode=[2])

        if warp == 0:
            # ---------------- producer: TMA ring ----------------
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for k in cutlass.range(k_tiles, unroll=1):
                pipe.producer_acquire(prod)
                bar = pipe.producer_get_barrier(prod)
                cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, k)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
                pipe.producer_commit(prod)
                prod.advance()

        if warp >= 4:
            # ---------------- consumers: wgmma ----------------
            ct = tidx - 128
            thr_mma = tiled_mma.get_slice(ct)
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            tCsD = thr_mma.partition_C(sD)
            acc = cute.make_rmem_tensor(tCsD.shape, Float32)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            n_kb = cute.size(tCrA, mode=[2])
            rd = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            for k in cutlass.range(k_tiles, unroll=1):
                pipe.consumer_wait(rd)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(n_kb):
                    cute.gemm(
                        tiled_mma,
                        acc,
                        tCrA[(None, None, kb, rd.index)],
                        tCrB[(None, None, kb, rd.index)],
                        acc,
                    )
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                if k > 0:
                    pipe.consumer_release(rel)
                    rel.advance()
                rd.advance()
            warpgroup.wait_group(0)
            if k_tiles > 0:
                pipe.consumer_release(rel)

            # ---------------- epilogue ----------------
            m = mD.shape[0]
            row0 = ti * tile
            col0 = tj * tile
            d_dtype = mD.element_type
            if const_expr(self.has_c):
                # alpha * acc + beta * C(ti, tj), C read in the accumulator's own layout, CHUNK
                # independent loads at a time so their latencies overlap. Only lower-triangle
                # tiles of C are read: the mirror below reuses them, so D is exactly symmetric.
                tCcD = thr_mma.partition_C(cute.make_identity_tensor((tile, tile)))
                n_acc = cute.size(acc)
                chunk = 16
                rC = cute.make_rmem_tensor(chunk, Float32)
                for c0 in cutlass.range_constexpr(n_acc // chunk):
                    for e in cutlass.range_constexpr(chunk):
                        rr, cc = tCcD[c0 * chunk + e]
                        c_row = row0 + rr
                        c_col = col0 + cc
                        rC[e] = Float32(0.0)
                        if c_row < m and c_col < m:
                            rC[e] = mC[c_row, c_col, bidz].to(Float32)
                    for e in cutlass.range_constexpr(chunk):
                        tCsD[c0 * chunk + e] = acc[c0 * chunk + e] * alpha + beta * rC[e]
            else:
                for e in cutlass.range(cute.size(acc), unroll_full=True):
                    tCsD[e] = acc[e] * alpha
            cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)

            # One column per thread, rows_per_step rows per step: consecutive threads touch
            # consecutive global columns (coalesced) in both the tile and its transpose; the odd
            # shared pitch makes the transposed (column) reads of sD conflict-free.
            rows_per_step = self.mma_threads // tile
            lr = ct // tile
            lc = ct % tile
            for step in cutlass.range(tile // rows_per_step, unroll=8):
                r = step * rows_per_step + lr
                gr = row0 + r
                gc = col0 + lc
                # A diagonal tile keeps its lower triangle and mirrors it too, so D is exactly
                # symmetric even where rounding made the operands commute only approximately
                # (later products rely on B^T == B bit for bit).
                if gr < m and gc < m and (ti != tj or r >= lc):
                    mD[gr, gc, bidz] = sD[r, lc].to(d_dtype)
                mr = col0 + r
                mc = row0 + lc
                if mr < m and mc < m and (ti != tj or lc > r):
                    mD[mr, mc, bidz] = sD[lc, r].to(d_dtype)


# -------------------------------------------------------------------------------------------
# Host side: compile once per (dtypes, tile, stages, has_c); launch on raw pointers (cheap).

import torch  # noqa: E402
from cutlass.cute.runtime import make_ptr  # noqa: E402

_TORCH_TO_CUTLASS = {
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.float32: cutlass.Float32,
}
_COMPILED: dict = {}
_STREAMS: dict = {}
_SMS: dict = {}


def _ptr(t: torch.Tensor):
    return make_ptr(_TORCH_TO_CUTLASS[t.dtype], t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)


def _stream():
    handle = torch.cuda.current_stream().cuda_stream
    s = _STREAMS.get(handle)
    if s is None:
        import cuda.bindings.driver as cuda_driver

        s = _STREAMS[handle] = cuda_driver.CUstream(handle)
    return s


def _sm_count() -> int:
    dev = torch.cuda.current_device()
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SMS[dev]


def default_tile(m: int, k: int, batch: int) -> int:
    """128-wide tiles unless they leave most SMs idle; then 64-wide ones."""
    nt = -(-m // 128)
    return 128 if batch * nt * (nt + 1) // 2 >= _sm_count() else 64


def compiled(ab: torch.dtype, d: torch.dtype, c: Optional[torch.dtype], tile: int, stages: Optional[int] = None):
    """The compiled kernel for one configuration (compiled on first use, then cached)."""
    stages = stages or max_stages(tile)
    key = (ab, d, c, tile, stages)
    fn = _COMPILED.get(key)
    if fn is None:
        kernel = SymmGemmSm90(
            _TORCH_TO_CUTLASS[ab], _TORCH_TO_CUTLASS[d], _TORCH_TO_CUTLASS[c] if c is not None else None, tile, stages
        )
        dummy = lambda dt: make_ptr(_TORCH_TO_CUTLASS[dt], 0, cute.AddressSpace.gmem, assumed_align=16)  # noqa: E731
        from cutlass.runtime import make_fake_stream

        fn = cute.compile(
            kernel,
            dummy(ab),
            dummy(ab),
            dummy(c or d),
            dummy(d),
            8,
            8,
            1,
            Float32(1.0),
            Float32(0.0),
            make_fake_stream(),
            options="--gpu-arch sm_90a",
        )
        _COMPILED[key] = fn
    return fn


def symm_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    tile: Optional[int] = None,
    stages: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """D = alpha * a @ b^T + beta * c for a, b (L, M, K) fp16/bf16 with a @ b^T symmetric.

    a is b for a Gram product; for a product P @ Q of commuting symmetric matrices pass b = Q
    (Q^T = Q). Only the lower triangle of tiles is computed; the upper is its mirror.
    c (L, M, M) must be symmetric. K must be a multiple of 8 (16-byte rows for TMA).
    Returns (L, M, M) in out_dtype (default a's dtype), or writes ``out``.
    """
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
    a = a.contiguous()
    b = b.contiguous()
    if out is None:
        out = torch.empty(batch, m, m, dtype=out_dtype or a.dtype, device=a.device)
    elif out.shape != (batch, m, m) or not out.is_contiguous():
        raise ValueError("out must be a contiguous (L, M, M) tensor")
    has_c = c is not None and beta != 0.0
    if has_c:
        c = c.expand(batch, m, m).contiguous()
    fn = compiled(a.dtype, out.dtype, c.dtype if has_c else None, tile or default_tile(m, k, batch), stages)
    fn(_ptr(a), _ptr(b), _ptr(c if has_c else out), _ptr(out), m, k, batch, Float32(alpha), Float32(beta), _stream())
    return out.squeeze(0) if squeeze else out
