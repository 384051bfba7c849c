"""The order in which the symmetric GEMM's CTAs walk their output tiles, and how stream-K shares
the last waves' K blocks among them: index arithmetic on the device, inherited by
:class:`.kernel.SymmGemmSm90`, which sets the attributes it reads (``tile_m``, ``tile_n``,
``cluster_m``, ``tile_group``, ``stream_k``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


class TileSchedule:
    """Linear tile indices -> output tiles (a banded walk of the lower triangle), and stream-K's
    split of the last waves' tiles along K."""

    # Set by the kernel that inherits the schedule (symm.kernel.SymmGemmSm90).
    tile_m: int
    tile_n: int
    cluster_m: int
    tile_group: int
    stream_k: bool | None

    @cute.jit
    def triangle_coord(self, t: Int32):
        """Linear index -> (row i, column j) of a lower triangle walked row by row (row i holds
        i + 1 entries and starts at i (i + 1) / 2)."""
        i = Int32((cute.math.sqrt(Float32(8 * t + 1)) - Float32(1.0)) * Float32(0.5))
        if (i + 1) * (i + 2) // 2 <= t:
            i = i + 1
        if i * (i + 1) // 2 > t:
            i = i - 1
        return i, t - i * (i + 1) // 2

    @cute.jit
    def block_coord(self, t: Int32, blocks: Int32):
        """Linear index -> (row, column) of a square block in the lower triangle of blocks x blocks,
        walked band by band, a band being ``tile_group`` block rows (every band after the previous
        one): first the columns left of the band's diagonal, column by column (consecutive blocks
        share a column panel and the band's row panels, so CTAs running at once reuse each other's
        operands in L2), then the band's own triangle row by row. A group of 1 is the triangle
        row by row."""
        group = self.tile_group
        i, _ = self.triangle_coord(t)  # the block row t has in the row-by-row walk: the same band
        r0 = i // group * group
        rows = blocks - r0
        if rows > group:
            rows = group
        idx = t - r0 * (r0 + 1) // 2
        row, col = r0 + idx % rows, idx // rows
        if idx >= rows * r0:
            a, b = self.triangle_coord(idx - rows * r0)
            row, col = r0 + a, r0 + b
        return row, col

    @cute.jit
    def tile_coord(self, t: Int32, m: Int32):
        """Linear index -> output tile (row block i, column block j) of an m x m result, in the
        banded order of :meth:`block_coord` over tile_n x tile_n blocks: a 128 x 256 tile is half
        a block (its two halves consecutive), and so is a 256 x 128 tile (its two column halves);
        with an odd count of 128-row blocks, the last row's tiles come last."""
        rows = (m + self.tile_m - 1) // self.tile_m
        i, j = Int32(0), Int32(0)
        if const_expr(self.tile_n == self.tile_m):
            i, j = self.block_coord(t, rows)
        elif const_expr(self.tile_m == 2 * self.tile_n):
            pairs = (m + self.tile_n - 1) // self.tile_n // 2
            if t >= pairs * (pairs + 1):
                i, j = pairs, t - pairs * (pairs + 1)
            else:
                bi, bj = self.block_coord(t // 2, pairs)
                i, j = bi, 2 * bj + t % 2
        else:
            pairs = rows // 2
            if t >= pairs * (pairs + 1):
                i, j = 2 * pairs, t - pairs * (pairs + 1)
            else:
                bi, bj = self.block_coord(t // 2, pairs)
                i, j = 2 * bi + t % 2, bj
        return i, j

    @cute.jit
    def tile_of(self, t: Int32, per_matrix: Int32, m: Int32, rank: Int32):
        """Linear tile index over (batch, triangle) of m x m results -> (this CTA's row block,
        column block, batch)."""
        ti, tj = self.tile_coord(t % per_matrix, m)
        return ti * self.cluster_m + rank, tj, t // per_matrix

    @cute.jit
    def split_start(self, cta: Int32, base: Int32, rem: Int32):
        """The first K block, counted over the split tiles, of CTA ``cta``'s share: ``base`` blocks
        each, one more for the first ``rem`` CTAs."""
        return cta * base + cutlass.min(cta, rem)

    @cute.jit
    def split_owner(self, unit: Int32, base: Int32, rem: Int32):
        """The CTA whose share (:meth:`split_start`) holds K block ``unit`` of the split tiles."""
        cta = unit // (base + 1)
        if unit >= rem * (base + 1):
            cta = rem + (unit - rem * (base + 1)) // cutlass.max(base, 1)
        return cta

    @cute.jit
    def stream_k_split(self, total: Int32, k_tiles: Int32, ctas: Int32, cta: Int32):
        """How a stream-K launch shares ``total`` tiles among ``ctas`` CTAs: whole tiles, strided,
        for all but the last one or two waves (none if the tiles fill whole waves), whose K blocks
        are then split evenly, each CTA taking a contiguous range of them (a split tile has as many
        parts as CTAs share it: two or three where there are more split tiles than CTAs, more where
        there are fewer). Returns (this CTA's whole tiles, the first split tile, base, rem of
        :meth:`split_start`, this CTA's work items)."""
        split_from = total
        if total % ctas != 0:
            split_from = cutlass.max(total // ctas - 1, 0) * ctas
        whole = split_from // ctas
        units = (total - split_from) * k_tiles
        base, rem = units // ctas, units % ctas
        start, end = self.split_start(cta, base, rem), self.split_start(cta + 1, base, rem)
        items = whole
        if end > start:
            items = whole + (end + k_tiles - 1) // k_tiles - start // k_tiles
        return whole, split_from, base, rem, items

    @cute.jit
    def work_item(
        self, w: Int32, first: Int32, stride: Int32, whole: Int32, split_from: Int32, base: Int32, rem: Int32, k_tiles: Int32, cta: Int32
    ):
        """This CTA's ``w``-th work item: (linear tile index, its K blocks [k0, k1)). Tiles
        ``first``, ``first + stride``, ... whole; with stream-K, after ``whole`` of them, the
        parts of the split tiles in this CTA's share (:meth:`stream_k_split`)."""
        t, k0, k1 = first + w * stride, Int32(0), k_tiles
        if const_expr(self.stream_k):
            if w >= whole:
                start, end = self.split_start(cta, base, rem), self.split_start(cta + 1, base, rem)
                st = start // k_tiles + (w - whole)  # among the split tiles
                t = split_from + st
                k0 = cutlass.max(start - st * k_tiles, 0)
                k1 = cutlass.min(end - st * k_tiles, k_tiles)
        return t, k0, k1
