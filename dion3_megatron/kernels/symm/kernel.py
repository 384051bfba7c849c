"""CuTe DSL symmetric GEMM for Hopper (sm_90a): D = alpha * A @ B^T + beta * C, one triangle.

Both products of Gram Newton-Schulz have this form:
  * gram       D = alpha * X X^T + beta * C      A = B = X (s x L, row-major: K-major; or the
                                                 transposed view of a row-major L x s matrix,
                                                 the tall input's Gram: M-major, read as it lies)
  * symmetric  D = alpha * P Q + beta * C        P, Q symmetric and commuting (s x s, row-major):
                                                 Q^T = Q, so Q's row-major storage is the K-major
                                                 "B" operand, and P Q is symmetric.
The kernel computes only the output tiles that meet the lower triangle and stores each element
(r, c) with r >= c twice, at (r, c) and at (c, r) (a diagonal element once), so every element of
D is written exactly once and D is exactly symmetric. beta * C is taken from C's lower triangle only
(C must be symmetric, as every addend of Gram NS is) and mirrored with the product (a persistent
launch's TMA copy of a tile that crosses the diagonal also reads the part above it, which no
store uses).

Structure (one CTA, or a cluster of two, per output tile, batched over grid z; or persistent:
one CTA per SM, each walking the batch's tiles in a fixed stride):
  * output tiles are tile_m x tile_n with tile_n = tile_m (64 or 128) or 2 * tile_m (128 x 256:
    fewer shared-memory reads per MMA, the shape fast GEMMs use); a wide tile that crosses the
    diagonal also covers some of the upper triangle, which it computes and drops;
  * 256 x 256 tiles are a cluster of two CTAs, each 128 x 256, that share the B operand: each
    loads half of it and multicasts it to both (half the L2 traffic for B); 256 x 128 tiles the
    same with 128 x 128 per CTA (a square CTA tile, so its stores go by TMA): three quarters of
    128 x 128's L2 traffic. A 256 x 128 tile's column block on the diagonal's right puts its top CTA
    above the diagonal: that CTA computes (its B half is the other's too) and stores nothing;
  * warpgroup 0, warp 0: TMA producer (bulk tensor copies of A and B k-slices into a multi-stage
    shared-memory ring, completion on mbarriers);
  * warpgroups 1..n: wgmma consumers, fp32 accumulators in registers (64 rows per warpgroup;
    128 x 256 tiles move registers from the producer warpgroup to them with setmaxnreg);
  * epilogue: alpha * accumulators -> fp32 shared tile, which reuses the operand ring (free once
    the main loop is done) -> two passes of 16-byte global stores, the tile's rows (+ beta * C,
    16-byte loads) and then its columns as rows of the transpose. A persistent launch hands the
    stores to warps that do no MMAs (the producer warpgroup's warps 1-3): the consumers stage the
    tile in the output dtype in a buffer beside the ring and go on to the next tile's MMAs while
    those warps store it (named barriers STAGED and FREE); one of those warps then starts a TMA
    copy of the next tile's C into that buffer (swizzled as TMA writes it; mbarrier c_full) while
    the consumers compute it, so that the consumers add beta * C from shared memory, not from
    global memory between two main loops. With a square tile per CTA (64 x 64, 128 x 128) the
    consumers also stage its transpose, and a tile below the diagonal goes out as two TMA copies
    (the block and its mirror) that one elected thread starts; diagonal tiles keep the two passes.
  * stream-K (a persistent launch of single CTAs): where the tiles would leave the last wave part
    empty, the tiles of the last one or two waves are split along K, each CTA taking an even,
    contiguous share of their K blocks after its whole tiles. A split tile's later parts leave fp32
    partial sums in a workspace (one slot and one flag per CTA); the CTA with its K block 0 adds
    them, in CTA order, and stores the tile.

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

from .. import config as kernel_config
from ..config import tile_shape
from .heuristics import CLUSTER_M, TILE_K, checked_ctas_per_sm, tile_count
from .schedule import TileSchedule

STORE_THREADS = 96  # a persistent launch's storing warps: the producer warpgroup's warps 1-3
# named barriers of a persistent epilogue: the tile staged / the staging read (and, with C, the
# next tile's C on its way) / the storing warps done reading it (before C's TMA copy goes over it)
STAGED, FREE, STORED = 2, 3, 4
SPLIT = 5  # named barrier of the consumers around a stream-K tile's partial sums
D_PAD = 8  # a persistent launch's staging pitch tn + 8 elements: 16-byte rows, spread banks
PAD = 4  # epilogue tile pitch tn + 4 floats: 16-byte rows, and no bank conflicts in either pass
VEC = 8  # elements per vector store of D (16 bytes of a half-precision output)
SMEM_BYTES = 227 * 1024  # usable dynamic shared memory per block on sm_90
SMEM_PER_SM = 228 * 1024  # one SM's shared memory, split among the CTAs resident on it
CTA_RESERVED = 1024  # shared memory the hardware reserves per resident CTA
BARRIER_BYTES = 2048  # the mbarriers, and alignment
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # setmaxnreg split of the 128 x 256 configuration


def smem_budget(ctas_per_sm: int = 1) -> int:
    """Bytes of shared memory one CTA may use for its ring and epilogue tile when ``ctas_per_sm``
    of them share an SM."""
    return min(SMEM_BYTES, SMEM_PER_SM // ctas_per_sm - CTA_RESERVED) - BARRIER_BYTES


def staging_bytes(tile_m: int, tile_n: int, d_bytes: int, persistent: bool) -> int:
    """Shared memory of one CTA's epilogue tile: fp32 with pitch tile_n + PAD, reusing the ring;
    with ``persistent`` the output dtype (``d_bytes`` per element) with pitch tile_n + D_PAD,
    beside the ring; for a square tile, whose stores are TMA copies, the tile and its transpose."""
    cta_m = tile_m // CLUSTER_M.get((tile_m, tile_n), 1)
    if not persistent:
        return cta_m * (tile_n + PAD) * 4
    return 2 * cta_m * tile_n * d_bytes if cta_m == tile_n else cta_m * (tile_n + D_PAD) * d_bytes


def max_stages(tile_m: int, tile_n: int, ab_bytes: int = 2, ctas_per_sm: int = 1, beside_ring: int = 0) -> int:
    """Pipeline depth that fits in shared memory beside ``beside_ring`` bytes (a persistent
    launch's staging tile; otherwise the epilogue tile reuses the ring)."""
    stage = (tile_m // CLUSTER_M.get((tile_m, tile_n), 1) + tile_n) * TILE_K * ab_bytes
    return max(2, min(8, (smem_budget(ctas_per_sm) - beside_ring) // stage))


class SymmGemmSm90(TileSchedule):
    """One compiled configuration: output tile ``tile`` (see :func:`tile_shape`), pipeline
    ``stages``, operand dtype ``ab``, output dtype ``d``, addend dtype ``c`` (None: no beta * C),
    and the operands' layout: K-major (rows of A and B contiguous), or with ``m_major`` M-major
    (columns contiguous: TMA loads them and the wgmma reads shared memory in that mode);
    ``ctas_per_sm``: how many CTAs the launch asks to keep resident per SM (shared memory and
    registers are sized for that many; None: the tile's :data:`.heuristics.DEFAULT_CTAS_PER_SM`);
    ``persistent_ctas``: launch that many CTAs (as many as stay resident at once, a multiple of the
    cluster size), each walking the tiles in a fixed stride, the stores handed to the producer
    warpgroup's idle warps (None: one CTA, or cluster, per output tile, whose consumers store it);
    ``tile_group``: the block rows of a band of the tile order (:meth:`block_coord`);
    ``stream_k``: a persistent launch that splits the tiles of its last waves along K among all
    its CTAs (:meth:`work_item`), so that no SM idles in a last, partial wave."""

    def __init__(
        self,
        ab,
        d,
        c=None,
        tile=128,
        stages: Optional[int] = None,
        m_major: bool = False,
        ctas_per_sm: Optional[int] = None,
        persistent_ctas: Optional[int] = None,
        tile_group: int = kernel_config.DEFAULT_TILE_GROUP,
        stream_k: bool = False,
    ):
        self.m_major = m_major
        self.tile_group = kernel_config.checked_tile_group(tile_group)
        self.tile_m, self.tile_n = tile_shape(tile)
        self.ctas_per_sm = ctas_per_sm = checked_ctas_per_sm(self.tile_m, self.tile_n, ctas_per_sm)
        self.ab_dtype, self.d_dtype, self.c_dtype = ab, d, c
        self.persistent_ctas = persistent_ctas
        persistent = persistent_ctas is not None
        staging = staging_bytes(self.tile_m, self.tile_n, d.width // 8, persistent)
        deepest = max_stages(self.tile_m, self.tile_n, ctas_per_sm=ctas_per_sm, beside_ring=staging if persistent else 0)
        self.stages = stages or deepest
        if self.stages > deepest:
            raise ValueError(f"{self.stages} stages do not fit in shared memory at tile {tile} with {ctas_per_sm} CTAs per SM")
        self.has_c = c is not None
        # A persistent launch's C comes by TMA into the staging tile (so it must be the output dtype)
        self.c_by_tma = persistent and self.has_c
        if self.c_by_tma and c is not d:
            raise ValueError(f"a persistent launch stages C in the output dtype {d}, got C in {c}")
        self.cluster_m = CLUSTER_M.get((self.tile_m, self.tile_n), 1)
        self.cta_m = self.tile_m // self.cluster_m  # rows of the tile one CTA computes
        self.stream_k = stream_k
        self.workspace_ctas = persistent_ctas or 1  # stream-K's slots of partial sums and flags
        if stream_k and not (persistent and self.cluster_m == 1):
            raise ValueError(f"stream_k needs a persistent launch of single CTAs, got tile {tile} with persistent_ctas={persistent_ctas}")
        # A persistent CTA's square tile goes out by TMA, staged twice: as computed and transposed
        # (the mirror block); a wider one (128 x 256) would not leave room for the ring
        self.d_by_tma = persistent and self.cta_m == self.tile_n
        self.n_mma_wg = self.cta_m // 64
        self.mma_threads = 128 * self.n_mma_wg
        self.threads = 128 + self.mma_threads
        self.split_registers = self.tile_n > 128  # 128 accumulator registers per consumer thread
        ring = self.stages * (self.cta_m + self.tile_n) * TILE_K * 2
        self.ring_elems = (ring if persistent else max(ring, staging)) // 2  # in 16-bit elements
        if 2 * self.ring_elems + (staging if persistent else 0) > smem_budget(ctas_per_sm):
            raise ValueError(f"the epilogue tile does not fit in shared memory at tile {tile} with {ctas_per_sm} CTAs per SM")

    # ---------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,  # (L, M, K) row-major, or with m_major (L, K, M) row-major
        pB: cute.Pointer,  # as pA
        pC: cute.Pointer,  # (L, M, M) row-major (ignored unless has_c)
        pD: cute.Pointer,  # (L, M, M) row-major
        pW: cute.Pointer,  # float32, stream-K: a tile of partial sums per CTA (ignored otherwise)
        pF: cute.Pointer,  # int32, stream-K: one flag per CTA, 1 while its partial sums wait, else 0
        m: Int32,
        k: Int32,
        batch: Int32,
        alpha: Float32,
        beta: Float32,
        stream,
    ):
        ab_dtype = self.ab_dtype
        tm, tn = self.cta_m, self.tile_n
        k8 = cute.assume(k, divby=8)
        ldd = cute.assume(cutlass.Int64(m), divby=8)  # rows of D and C start 16-byte aligned
        if const_expr(self.m_major):
            ab_layout = cute.make_layout((m, k8, batch), stride=(1, ldd, ldd * k8))
        else:
            ld = cutlass.Int64(k8)
            ab_layout = cute.make_layout((m, k8, batch), stride=(ld, 1, ld * m))
        mA = cute.make_tensor(pA, ab_layout)
        mB = cute.make_tensor(pB, ab_layout)
        mD = cute.make_tensor(pD, cute.make_layout((m, m, batch), stride=(ldd, 1, ldd * m)))
        mC = mD
        if const_expr(self.has_c):
            mC = cute.make_tensor(pC, cute.make_layout((m, m, batch), stride=(ldd, 1, ldd * m)))
        # a CTA's partial sums as its consumer threads hold them: element e of thread t at (e, t),
        # so that a warp's stores of one element are contiguous
        per_thread = tm * tn // self.mma_threads
        mW = cute.make_tensor(
            pW,
            cute.make_layout(
                (per_thread, self.mma_threads, self.workspace_ctas), stride=(self.mma_threads, 1, per_thread * self.mma_threads)
            ),
        )
        mF = cute.make_tensor(pF, cute.make_layout(self.workspace_ctas))

        tile_mnk = (tm, tn, TILE_K)
        major, gmem_order = OperandMajorMode.K, LayoutEnum.ROW_MAJOR
        if const_expr(self.m_major):
            major, gmem_order = OperandMajorMode.MN, LayoutEnum.COL_MAJOR
        tiled_mma = sm90.make_trivial_tiled_mma(
            ab_dtype,
            ab_dtype,
            major,
            major,
            Float32,
            (self.n_mma_wg, 1, 1),
            tiler_mn=(64, tn),
        )
        a_layout = sm90.make_smem_layout_a(gmem_order, tile_mnk, ab_dtype, self.stages)
        b_layout = sm90.make_smem_layout_b(gmem_order, tile_mnk, ab_dtype, self.stages)
        tma_a, tA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(a_layout, (None, None, 0)), (tm, TILE_K))
        b_op = cpasync.CopyBulkTensorTileG2SOp() if self.cluster_m == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
        tma_b, tB = cpasync.make_tiled_tma_atom(
            b_op, mB, cute.slice_(b_layout, (None, None, 0)), (tn, TILE_K), num_multicast=self.cluster_m
        )
        # The epilogue tile reuses sA and sB (adjacent: sA's size is a multiple of 1 KiB); sB
        # is lengthened where the ring alone would be smaller than the epilogue tile. A persistent
        # launch stages the tile in sE beside the ring (a one-element stand-in otherwise): rows
        # padded to spread banks, or with C swizzled, the layout C's TMA copy writes.
        b_elems = self.ring_elems - cute.cosize(a_layout)
        e_layout = cute.make_layout((tm, tn), stride=(tn + D_PAD, 1))
        tma_c, tC, tma_d, tD = tma_a, tA, tma_a, tA  # stand-ins unless C comes, or D goes, by TMA
        if const_expr(self.c_by_tma or self.d_by_tma):
            e_layout = cute.slice_(sm90.make_smem_layout_epi(self.d_dtype, LayoutEnum.ROW_MAJOR, (tm, tn), 1), (None, None, 0))
        if const_expr(self.c_by_tma):
            tma_c, tC = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mC, e_layout, (tm, tn))
        if const_expr(self.d_by_tma):
            tma_d, tD = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mD, e_layout, (tm, tn))
        e_elems = cute.cosize(e_layout) if self.persistent_ctas is not None else 1
        t_elems = cute.cosize(e_layout) if self.d_by_tma else 1

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            c_full: cute.struct.MemRange[cutlass.Int64, 1]  # persistent, with C: the tile's C is in sE
            sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, b_elems], 1024]
            sE: cute.struct.Align[cute.struct.MemRange[self.d_dtype, e_elems], 1024]
            sT: cute.struct.Align[cute.struct.MemRange[self.d_dtype, t_elems], 1024]  # the transpose, D by TMA

        self.storage = Storage
        if const_expr(self.persistent_ctas is None):
            grid = (tile_count(m, self.tile_m, tn) * self.cluster_m, 1, batch)
        else:  # CTAs beyond the tiles find none and exit
            grid = (self.persistent_ctas, 1, 1)
        # several CTAs per SM: registers capped for that many (minctasm), the largest shared-memory carveout
        occupancy = {} if self.ctas_per_sm == 1 else dict(min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100)
        self.kernel(
            tma_a, tA, tma_b, tB, tma_c, tC, tma_d, tD, mC, mD, mW, mF, alpha, beta, tiled_mma, a_layout, b_layout, e_layout
        ).launch(grid=grid, block=[self.threads, 1, 1], cluster=(self.cluster_m, 1, 1), stream=stream, **occupancy)

    @cute.jit
    def exchange_partial_sums(
        self,
        acc: cute.Tensor,
        mW: cute.Tensor,
        mF: cute.Tensor,
        t: Int32,
        k0: Int32,
        k1: Int32,
        k_tiles: Int32,
        ct: Int32,
        split_from: Int32,
        base: Int32,
        rem: Int32,
        cta: Int32,
    ):
        """Stream-K, by the consumers after a work item's MMAs: a later part of a split tile
        (``k0 > 0``) leaves its partial sums in this CTA's slot of the workspace and raises the
        CTA's flag; the part with K block 0, whose CTA stores the tile, adds the partial sums of
        the CTAs that hold the tile's other parts, in CTA order (the same sum in every launch),
        each once its flag is up, and lowers the flag for the next launch. The later parts come
        first in their CTAs' shares and wait for nothing, so the wait ends once they are resident."""
        if k0 > 0:
            for e in cutlass.range_constexpr(cute.size(acc)):
                mW[e, ct, cta] = acc[e]
            cute.arch.barrier(barrier_id=SPLIT, number_of_threads=self.mma_threads)
            if ct == 0:  # every consumer's stores before the flag, at GPU scope
                cute.arch.fence_acq_rel_gpu()
                cute.arch.store(mF.iterator + cta, Int32(1), sem="relaxed", scope="gpu")
        elif k1 < k_tiles:
            st = t - split_from  # among the split tiles
            last = self.split_owner(st * k_tiles + k_tiles - 1, base, rem)
            for q in cutlass.range(self.split_owner(st * k_tiles + k1, base, rem), last + 1, unroll=1):
                if ct == 0:  # the acquiring load also drops this SM's L1 copies of the workspace
                    flag = cute.arch.load(mF.iterator + q, Int32, sem="acquire", scope="gpu")
                    while flag == 0:
                        flag = cute.arch.load(mF.iterator + q, Int32, sem="acquire", scope="gpu")
                    cute.arch.store(mF.iterator + q, Int32(0), sem="relaxed", scope="gpu")
                cute.arch.barrier(barrier_id=SPLIT, number_of_threads=self.mma_threads)
                for e in cutlass.range_constexpr(cute.size(acc)):
                    acc[e] = acc[e] + mW[e, ct, q]

    @cute.jit
    def row_vector(self, item: Int32, row0: Int32, col0: Int32):
        """The item-th vector of VEC elements of a tile walked row by row (the tile's top-left
        element at [row0, col0]): (item, its row r in the tile, its index pv in the row, and its
        first element's row and column in the matrix)."""
        per_row = self.tile_n // VEC
        r, pv = item // per_row, item % per_row
        return item, r, pv, row0 + r, col0 + pv * VEC

    @cute.jit
    def copy_out(self, tma_d: cute.CopyAtom, staged: cute.Tensor, mD_tma: cute.Tensor, i: Int32, j: Int32, bz: Int32):
        """Start the TMA copy of the staged tile to D's block (i, j) of matrix bz."""
        gD = cute.local_tile(mD_tma, (self.cta_m, self.tile_n), (i, j, bz))
        tDsD, tDgD = cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(staged, 0, 2), cute.group_modes(gD, 0, 2))
        cute.copy(tma_d, tDsD, tDgD)

    @cute.jit
    def store_tile(
        self,
        sD: cute.Tensor,
        mC: cute.Tensor,
        mD: cute.Tensor,
        beta: Float32,
        row0: Int32,
        col0: Int32,
        bz: Int32,
        tid: Int32,
        threads: cutlass.Constexpr[int],
        add_c: cutlass.Constexpr[bool],
    ):
        """Store the staged tile sD (tm x tn, alpha applied; fp32, or the output dtype) whose
        top-left element is D[row0, col0], and its mirror, by ``threads`` threads (this one ``tid``).

        Element (r, c) of the tile is stored at (r, c) if on or below the diagonal and at (c, r)
        if below it: every element of D once, and D exactly symmetric even where rounding made the
        operands commute only approximately (later products rely on B^T == B bit for bit). Both
        passes store VEC consecutive elements of a row of D per thread (one 16-byte store where
        the whole vector is on its side of the diagonal). With ``add_c`` beta * C is added in the
        first pass, from C's lower triangle only, and the sum kept in sD for the mirrored second
        pass (a persistent launch's consumers add it before staging)."""
        tm, tn = self.cta_m, self.tile_n
        m = mD.shape[0]
        d_dtype = mD.element_type
        rD = cute.make_rmem_tensor(VEC, d_dtype)
        rC = cute.make_rmem_tensor(VEC, mC.element_type)
        # pass 1: D[row0 + r, col0 + c : col0 + c + VEC] from sD[r, c : c + VEC]
        items = tm * (tn // VEC)
        for step in cutlass.range((items + threads - 1) // threads, unroll=4):
            item, r, pv, gr, gc = self.row_vector(step * threads + tid, row0, col0)
            if item < items and gr < m and gc <= gr:
                sv = cute.local_tile(sD[r, None], (VEC,), (pv,))
                v = sv.load()
                if const_expr(add_c):
                    cute.autovec_copy(cute.local_tile(mC[gr, None, bz], (VEC,), (gc // VEC,)), rC)
                    v = v + beta * rC.load().to(Float32)
                    sv.store(v)
                rD.store(v.to(d_dtype))
                gD = cute.local_tile(mD[gr, None, bz], (VEC,), (gc // VEC,))
                if gc + VEC - 1 <= gr:
                    cute.autovec_copy(rD, gD)
                else:
                    for e in cutlass.range_constexpr(VEC):
                        if gc + e <= gr:
                            gD[e] = rD[e]
        if const_expr(add_c):
            cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        # pass 2: D[col0 + c, row0 + r : row0 + r + VEC] from sD[r : r + VEC, c]; consecutive
        # threads take consecutive c, so their shared-memory reads are conflict-free
        items = tn * (tm // VEC)
        for step in cutlass.range((items + threads - 1) // threads, unroll=4):
            item = step * threads + tid
            c, r = item % tn, (item // tn) * VEC
            gr, gc = row0 + r, col0 + c
            if item < items and gr < m and gc < gr + VEC - 1:
                for e in cutlass.range_constexpr(VEC):
                    rD[e] = sD[r + e, c].to(d_dtype)
                gD = cute.local_tile(mD[gc, None, bz], (VEC,), (gr // VEC,))
                if gc < gr:
                    cute.autovec_copy(rD, gD)
                else:
                    for e in cutlass.range_constexpr(VEC):
                        if gc < gr + e:
                            gD[e] = rD[e]

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC_tma: cute.Tensor,
        tma_d: cute.CopyAtom,
        mD_tma: cute.Tensor,
        mC: cute.Tensor,
        mD: cute.Tensor,
        mW: cute.Tensor,
        mF: cute.Tensor,
        alpha: Float32,
        beta: Float32,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
        e_layout,
    ):
        tm, tn = self.cta_m, self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, bidz = cute.arch.block_idx()

        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            if const_expr(self.c_by_tma):
                cpasync.prefetch_descriptor(tma_c)
            if const_expr(self.d_by_tma):
                cpasync.prefetch_descriptor(tma_d)

        rank = Int32(0)  # CTA within the cluster: its 128-row slice of each tile
        if const_expr(self.cluster_m > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        # The tiles this CTA computes, as linear indices over (batch, the triangle's tiles): one
        # (bidz, bidx) of its own, or with a persistent launch every n_clusters-th from its cluster's.
        m = mD.shape[0]
        per_matrix = tile_count(m, self.tile_m, tn)
        total = per_matrix * mD.shape[2]
        first, stride = Int32(bidz) * per_matrix + Int32(bidx) // self.cluster_m, total
        if const_expr(self.persistent_ctas is not None):
            grid_x, _, _ = cute.arch.grid_dim()
            first, stride = Int32(bidx) // self.cluster_m, Int32(grid_x) // self.cluster_m
        tile_mnk = (tm, tn, TILE_K)
        k_tiles = cute.size(cute.local_tile(mA, tile_mnk, (0, 0, None, 0), proj=(1, None, 1)), mode=[2])
        # work items (work_item): whole tiles, and with stream-K the parts of the split ones
        items = (total - first + stride - 1) // stride
        whole, split_from, base, rem = items, total, Int32(0), Int32(0)
        if const_expr(self.stream_k):
            whole, split_from, base, rem, items = self.stream_k_split(total, k_tiles, stride, first)
        work = (first, stride, whole, split_from, base, rem, k_tiles, first)  # the last: this CTA's slot

        smem = SmemAllocator()
        st = smem.allocate(self.storage)
        sA = st.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = st.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        persistent = self.persistent_ctas is not None
        # the epilogue tile: fp32 in the drained ring, or a persistent launch's, in the output dtype, beside it
        # D by TMA: sT is the mirror block as its TMA copy reads it (the tile transposed), sT_view
        # the same memory indexed as the tile, (r, c) at sT's (c, r), which the consumers write
        sD = sT = sT_view = None
        if const_expr(self.c_by_tma or self.d_by_tma):
            sD = st.sE.get_tensor(e_layout.outer, swizzle=e_layout.inner)
            if const_expr(self.d_by_tma):
                sT = st.sT.get_tensor(e_layout.outer, swizzle=e_layout.inner)
                sT_view = st.sT.get_tensor(cute.select(e_layout.outer, mode=[1, 0]), swizzle=e_layout.inner)
        elif const_expr(persistent):
            sD = st.sE.get_tensor(e_layout)
        else:
            sD = st.sA.get_tensor(cute.make_layout((tm, tn), stride=(tn + PAD, 1)), dtype=Float32)
        staging_sync = self.mma_threads + STORE_THREADS  # the threads on STAGED and FREE

        a_stage = cute.slice_(a_layout, (None, None, 0))
        b_stage = cute.slice_(b_layout, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.ab_dtype, a_stage) + cute.size_in_bytes(self.ab_dtype, b_stage)
        c_full = st.c_full.data_ptr()
        if const_expr(self.c_by_tma):
            if warp == 1:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(c_full, 1)  # one arrival: the thread that starts the copy
        cluster = cute.make_layout((self.cluster_m, 1, 1))
        multicast = self.cluster_m > 1
        # One release per consumer warp; with multicast, one per warp and per CTA that B went to (the
        # pipeline counts it from the consumer threads): a stage is free once all of them released it.
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads if multicast else self.n_mma_wg * 4),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)),
            mcast_mode_mn=(0, 1),
            enable_multicast_signaling=multicast,
        )

        if warp < 4:
            if const_expr(self.split_registers):
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                # ---------------- producer: TMA ring, across tiles ----------------
                b_mask = cute.make_layout_image_mask(cluster, (rank, 0, 0), mode=0)
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for w in cutlass.range(items, unroll=1):
                    t, k0, k1 = self.work_item(w, *work)
                    ti, tj, bz = self.tile_of(t, per_matrix, m, rank)
                    gA = cute.local_tile(mA, tile_mnk, (ti, tj, None, bz), proj=(1, None, 1))  # (tm, BK, kt)
                    gB = cute.local_tile(mB, tile_mnk, (ti, tj, None, bz), proj=(None, 1, 1))  # (tn, BK, kt)
                    tAsA, tAgA = cpasync.tma_partition(
                        tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
                    )
                    # each CTA of a cluster loads 1 / cluster_m of B and multicasts it to all of them
                    tBsB, tBgB = cpasync.tma_partition(
                        tma_b, rank, cute.make_layout(self.cluster_m), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
                    )
                    for k in cutlass.range(k0, k1, unroll=1):
                        pipe.producer_acquire(prod)
                        bar = pipe.producer_get_barrier(prod)
                        cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                        if const_expr(self.cluster_m == 1):
                            cute.copy(tma_b, tBgB[(None, k)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
                        else:
                            cute.copy(tma_b, tBgB[(None, k)], tBsB[(None, prod.index)], tma_bar_ptr=bar, mcast_mask=b_mask)
                        pipe.producer_commit(prod)
                        prod.advance()
            if const_expr(persistent):
                if warp > 0:
                    # ---------------- storing warps: a persistent launch's epilogue ----------------
                    c_bytes = cute.size_in_bytes(self.d_dtype, e_layout)
                    for w in cutlass.range(items, unroll=1):
                        t, k0, k1 = self.work_item(w, *work)
                        if k0 == 0:  # a later part of a split tile goes to the workspace, not here
                            ti, tj, bz = self.tile_of(t, per_matrix, m, rank)
                            if const_expr(self.d_by_tma):
                                if warp == 1:  # the previous tile's TMA copies done reading the staging
                                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                            if const_expr(self.has_c):  # this tile's C by TMA, while the consumers compute it
                                if warp == 1:
                                    with cute.arch.elect_one():
                                        cute.arch.mbarrier_arrive_and_expect_tx(c_full, c_bytes)
                                    gC = cute.local_tile(mC_tma, (tm, tn), (ti, tj, bz))
                                    tCsC, tCgC = cpasync.tma_partition(
                                        tma_c, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), cute.group_modes(gC, 0, 2)
                                    )
                                    cute.copy(tma_c, tCgC, tCsC, tma_bar_ptr=c_full)
                            cute.arch.barrier_arrive(barrier_id=FREE, number_of_threads=staging_sync)  # sD is read
                            cute.arch.barrier(barrier_id=STAGED, number_of_threads=staging_sync)
                            if const_expr(self.d_by_tma):
                                if ti > tj:  # below the diagonal: the block and its mirror, two TMA copies
                                    if warp == 1:  # one thread: bulk groups are per thread
                                        with cute.arch.elect_one():
                                            self.copy_out(tma_d, sD, mD_tma, ti, tj, bz)
                                            self.copy_out(tma_d, sT, mD_tma, tj, ti, bz)
                                            cute.arch.cp_async_bulk_commit_group()
                                elif ti == tj:  # (above it, a 256 x 128 tile's top CTA: nothing)
                                    self.store_tile(sD, mC, mD, beta, ti * tm, tj * tn, bz, tidx - 32, STORE_THREADS, False)
                            else:
                                self.store_tile(sD, mC, mD, beta, ti * tm, tj * tn, bz, tidx - 32, STORE_THREADS, False)
                            if const_expr(self.has_c):  # every storing warp done with sD before C goes over it
                                cute.arch.barrier(barrier_id=STORED, number_of_threads=STORE_THREADS)
                    if const_expr(self.d_by_tma):
                        if warp == 1:  # the staging stays allocated until the last copy has read it
                            cute.arch.cp_async_bulk_wait_group(0, read=True)

        if warp >= 4:
            if const_expr(self.split_registers):
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
            # ---------------- consumers: wgmma, then the epilogue, tile after tile ----------------
            ct = tidx - 128
            thr_mma = tiled_mma.get_slice(ct)
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            tCsD = thr_mma.partition_C(sD)
            tCsT = thr_mma.partition_C(sT_view) if const_expr(self.d_by_tma) else None
            acc = cute.make_rmem_tensor(tCsD.shape, Float32)
            n_kb = cute.size(tCrA, mode=[2])
            rd = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            c_phase = Int32(0)  # parity of c_full's next completion
            for w in cutlass.range(items, unroll=1):
                t, k0, k1 = self.work_item(w, *work)
                ti, tj, bz = self.tile_of(t, per_matrix, m, rank)
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                # each stage's barrier is polled once ahead (try_wait) while the MMAs before it run
                ready = cutlass.Boolean(True)
                if k1 > k0:
                    ready = pipe.consumer_try_wait(rd)
                for k in cutlass.range(k0, k1, unroll=1):
                    pipe.consumer_wait(rd, ready)
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
                    if k > k0:
                        pipe.consumer_release(rel)
                        rel.advance()
                    rd.advance()
                    ready = cutlass.Boolean(True)
                    if k + 1 < k1:
                        ready = pipe.consumer_try_wait(rd)
                warpgroup.wait_group(0)
                if k1 > k0:
                    pipe.consumer_release(rel)
                    rel.advance()
                if const_expr(self.stream_k):
                    self.exchange_partial_sums(acc, mW, mF, t, k0, k1, k_tiles, ct, split_from, base, rem, first)

                # ---------------- epilogue: the tile's, by the CTA holding its K block 0 ----------------
                if k0 == 0:
                    row0, col0 = ti * tm, tj * tn
                    if const_expr(persistent):
                        # once the storing warps have read the previous tile (and put this one's C in
                        # sD), stage alpha * acc + beta * C in the output dtype for them, element by
                        # element in place (a second tile of registers would not fit beside acc), and go
                        # on to the next tile's MMAs
                        cute.arch.barrier(barrier_id=FREE, number_of_threads=staging_sync)
                        if const_expr(self.has_c):
                            cute.arch.mbarrier_wait(c_full, c_phase)
                            c_phase = c_phase ^ 1
                        for e in cutlass.range_constexpr(cute.size(acc)):
                            acc[e] = acc[e] * alpha
                            if const_expr(self.has_c):
                                acc[e] = acc[e] + beta * tCsD[e].to(Float32)
                        staged = acc.load().to(self.d_dtype)
                        tCsD.store(staged)
                        if const_expr(self.d_by_tma):
                            tCsT.store(staged)  # type: ignore[union-attr]  # set wherever d_by_tma
                        if const_expr(self.c_by_tma or self.d_by_tma):  # these writes before TMA copies touch them
                            cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier_arrive(barrier_id=STAGED, number_of_threads=staging_sync)
                    else:
                        # sD reuses the ring: every warpgroup's MMAs must be done reading it
                        cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)
                        for e in cutlass.range(cute.size(acc), unroll_full=True):
                            tCsD[e] = acc[e] * alpha
                        cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)
                        self.store_tile(sD, mC, mD, beta, row0, col0, bz, ct, self.mma_threads, self.has_c)

        if const_expr(self.cluster_m > 1):
            # no CTA exits while a peer may still arrive on its barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()


# -------------------------------------------------------------------------------------------
# Host side: compile once per (dtypes, tile, stages, has_c); launch on raw pointers (cheap).
