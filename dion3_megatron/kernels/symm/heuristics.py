"""Which launch a symmetric product gets: whether it goes to the kernel at all (routing), and at
which tile, persistent or one CTA per tile, split along K (stream-K) or not (the tile model).

Pure Python over the product's shape and the kernel configuration (:mod:`..config`): no CuTe DSL
import, so the decisions are tested on any machine (tests/unit/test_kernels_cpu.py). The device's SM
count, L2 size and cluster occupancy are read once per device. Every constant here was fitted
to side-by-side measurements on an H200 (``benchmarks/bench_symm.py --sweep --fit``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .. import config as kernel_config
from ..config import TILES, KernelConfig

TILE_K = 64  # the K depth of one pipeline stage
CLUSTER_M = {(256, 256): 2, (256, 128): 2}  # CTAs per tile along M (one 128-row slice each); 1 for the others
# CTAs per SM a tile may ask for: one CTA's epilogue (stores, no MMAs) and pipeline bubbles then
# overlap another's main loop. Only 64 x 64 (192 threads, 32 accumulators each) has registers to
# spare: two CTAs of 128 x 128 (384 threads) leave 80 registers per thread, and ptxas needs 90 for
# its wgmma; 128 x 256 and 256 x 256 take the whole register file (setmaxnreg).
CTAS_PER_SM = {(64, 64): (1, 2, 3, 4), (128, 128): (1,), (128, 256): (1,), (256, 128): (1,), (256, 256): (1,)}
# What a launch asks for unless told: two CTAs of 64 x 64 per SM beat one on every product the tile
# model gives that tile (512-2048 wide: 1024 x 5120 0.023 against 0.029 ms, 1024^2 0.009 against
# 0.012); three or four win on some shapes and lose more on others.
DEFAULT_CTAS_PER_SM = {(64, 64): 2}

# Routing counts a product in 128 x 256 tiles, the kernel's usual one (KernelConfig.min_tiles).
ROUTING_TILE = (128, 256)
# The longest K that stream-K splits: at K = 12288 it lost (3072 x 12288, 0.255 against 0.247 ms
# persistent; the CTAs, each at another K offset, share less of the operand in L2).
SPLIT_MAX_K = 8192


def tile_count(m, tile_m: int, tile_n: int):
    """Output tiles that meet the lower triangle of an m x m result (column block j covers columns
    [j tile_n, (j + 1) tile_n)): row block i has i + 1 of them for a square tile, i // 2 + 1 for a
    128 x 256 one, and 2 i + 2 for a 256 x 128 one (with an odd count of 128-row blocks, the last
    block row, 128 rows high, 2 i + 1). Python ints on the host, Int32 inside kernels."""
    rows = (m + tile_m - 1) // tile_m
    if tile_n == tile_m:
        return rows * (rows + 1) // 2
    if tile_m == 2 * tile_n:
        blocks = (m + tile_n - 1) // tile_n  # of 128 rows
        pairs = blocks // 2
        return pairs * (pairs + 1) + (blocks % 2) * (2 * pairs + 1)
    pairs = rows // 2
    return pairs * (pairs + 1) + (rows % 2) * (pairs + 1)


def checked_ctas_per_sm(tile_m: int, tile_n: int, ctas_per_sm: Optional[int]) -> int:
    """``ctas_per_sm`` if the tile allows it (:data:`CTAS_PER_SM`), the tile's default for None."""
    if ctas_per_sm is None:
        return DEFAULT_CTAS_PER_SM.get((tile_m, tile_n), 1)
    if ctas_per_sm not in CTAS_PER_SM[tile_m, tile_n]:
        raise ValueError(f"ctas_per_sm at tile {tile_m}x{tile_n} must be one of {CTAS_PER_SM[tile_m, tile_n]}, got {ctas_per_sm!r}")
    return ctas_per_sm


# --------------------------------------------------------------------------------------------
# Routing: which products go to the kernel.


def routes_to_kernel(batch: int, m: int, k: int, dtype: torch.dtype, config: Optional[KernelConfig] = None) -> bool:
    """Whether a (batch, m, k) symmetric product goes to the kernel (shape and dtype only) under
    ``config`` (default: the one in force): with routing "measured", only those that fill the GPU
    (``KernelConfig.min_tiles``), or, where stream-K may split them, at least
    ``KernelConfig.min_width`` wide: smaller ones measured slower than cuBLAS, graphed and eager.
    Eager and captured calls route alike, so a step replayed from a CUDA graph computes what its
    eager warm-up computed, bit for bit."""
    config = config or kernel_config.current()
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if m % 8 or k % 8:  # TMA needs 16-byte row strides
        return False
    if config.routing == "always":
        return True
    if config.stream_k is not False and m >= config.min_width and k <= SPLIT_MAX_K:
        return True
    return batch * tile_count(m, *ROUTING_TILE) >= config.min_tiles


# --------------------------------------------------------------------------------------------
# The device.

_DEVICE_PROPERTIES: dict = {}
_RESIDENT: dict = {}


def _device_property(name: str) -> int:
    """The current device's property ``name`` (of torch.cuda.get_device_properties), read once per device."""
    key = (torch.cuda.current_device(), name)
    if key not in _DEVICE_PROPERTIES:
        _DEVICE_PROPERTIES[key] = getattr(torch.cuda.get_device_properties(key[0]), name)
    return _DEVICE_PROPERTIES[key]


def sm_count() -> int:
    return _device_property("multi_processor_count")


def l2_bytes() -> int:
    return _device_property("L2_cache_size")


def resident_clusters(cluster_m: int) -> int:
    """Clusters of ``cluster_m`` CTAs, one CTA per SM, that the current device keeps resident at
    once: every SM for single CTAs; for pairs what its GPCs allow (an SM without a partner in its
    GPC stays out), from the driver's occupancy query. Sizes a persistent grid: a cluster that
    does not fit would start only when another had walked all its tiles."""
    key = (torch.cuda.current_device(), cluster_m)
    if key not in _RESIDENT:
        if cluster_m == 1:
            _RESIDENT[key] = sm_count()
        else:
            from cutlass.utils import HardwareInfo

            _RESIDENT[key] = HardwareInfo(torch.cuda.current_device()).get_max_active_clusters(cluster_m)
    return _RESIDENT[key]


# --------------------------------------------------------------------------------------------
# The tile model.

# Relative throughput of one SM per tile shape (wider tiles read less shared memory per MMA,
# clusters half the L2 traffic of B), fitted to a side-by-side sweep of every tile: with these the
# model picks the fastest tile, or one within 3% of it, on every shape of the sweep.
TILE_THROUGHPUT = {(64, 64): 0.55, (128, 128): 0.9, (128, 256): 0.95, (256, 128): 0.927, (256, 256): 1.0}
# Tiles offered only where an operand (batch x m x k) is over half the L2 cache. 256 x 128, a
# cluster of two 128 x 128 CTAs that share B (three quarters of 128 x 128's L2 traffic), won there
# (16 x 1024^2 with C, 32 MiB operands: 0.054-0.056 ms against 0.055-0.057 for 128 x 128;
# 16 x 1024 x 5120 X X^T 0.182 against 0.190-0.196; 5120 x 13824 0.626 against 0.704) and lost
# where its operands fit (8 x 1024^2 with C, 16 MiB: 0.041 against 0.036).
L2_BOUND_TILES = ((256, 128),)
# A stream-K launch's time, in waves, is its fraction of waves plus this: its partial sums' round
# trip. Measured (time per wave from the same product's persistent launch), split 128 x 128 took
# 6.21 + 0.5 waves on 5120^2 with C (0.250-0.253 ms, 7 waves 0.262-0.268), 4.36 + 0.5 on
# 16 x 1024 x 5120 X X^T (0.190-0.194, 5 waves 0.196), 2.18 + 0.5 on 8 x 1024 x 5120 (0.099-0.104,
# 3 waves 0.116) and 1.03 + 0.5 on 2048 x 8192 (0.077-0.080, 2 waves 0.101); against 256 x 128 the
# first two bound it to 0.49-0.58.
SPLIT_WAVE_COST = 0.5


def modelled_tile_time(m: int, batch: int, shape: tuple[int, int], throughput: float, sms: int, split: bool = False) -> float:
    """A product's modelled time at tile ``shape`` (arbitrary units): waves of CTAs over ``sms`` SMs
    (whole waves; with ``split``, stream-K's, the fraction plus :data:`SPLIT_WAVE_COST`) times one
    CTA's tile area over its relative ``throughput``."""
    ctas = batch * tile_count(m, *shape) * CLUSTER_M.get(shape, 1)
    waves = ctas / sms + SPLIT_WAVE_COST if split else -(-ctas // sms)
    return waves * shape[0] * shape[1] / CLUSTER_M.get(shape, 1) / throughput


@functools.lru_cache(maxsize=None)
def default_tile(m: int, batch: int, k: int, split_allowed: bool = True) -> tuple[int, int]:
    """The tile shape with the least modelled time (TILE_THROUGHPUT): waves of tiles times a tile's
    time. Wide tiles run faster per element, but fewer of them can leave SMs idle in the last wave,
    unless stream-K (where ``split_allowed`` and :func:`stream_k_pays`) spreads that wave's tiles.
    :data:`L2_BOUND_TILES` only where an operand is over half the L2 cache."""
    sms = sm_count()
    l2_bound = batch * m * k * 2 > l2_bytes() // 2  # fp16 / bf16 operands
    offered = [shape for shape in TILES if l2_bound or shape not in L2_BOUND_TILES]
    return min(
        offered,
        key=lambda shape: modelled_tile_time(
            m, batch, shape, TILE_THROUGHPUT[shape], sms, split_allowed and stream_k_pays(batch, m, k, shape)
        ),
    )


def persistent_ctas(shape: tuple[int, int], ctas_per_sm: Optional[int] = None) -> int:
    """The CTAs of a persistent launch at tile ``shape``: as many as stay resident at once (whole
    clusters, ``ctas_per_sm`` per SM), which is also one wave of a launch of one CTA per tile."""
    cluster_m = CLUSTER_M.get(shape, 1)
    return resident_clusters(cluster_m) * cluster_m * checked_ctas_per_sm(*shape, ctas_per_sm)


PERSISTENT_MIN_WAVES = 2


def persistent_pays(batch: int, m: int, shape: tuple[int, int], ctas_per_sm: Optional[int] = None) -> bool:
    """Whether a launch of one CTA (or cluster) per output tile would take at least
    PERSISTENT_MIN_WAVES waves of resident CTAs: only then does a persistent CTA walk several tiles,
    each one's stores overlapping the next one's MMAs. Measured: persistent won every product of 2
    waves or more (4096^2 to 8 x 4096x16384; with C since C comes by TMA, K = 1024 too: 16 x 1024^2
    0.059 against 0.069 ms) and lost 8 x 1024^2 without C (1.2 waves: 0.117 against 0.079 ms)."""
    ctas_per_tile = CLUSTER_M.get(shape, 1)
    return batch * tile_count(m, *shape) * ctas_per_tile >= PERSISTENT_MIN_WAVES * persistent_ctas(shape, ctas_per_sm)


# Stream-K where the tiles fill under SPLIT_MAX_FILL of the waves a persistent launch takes, K is
# at most SPLIT_MAX_K and each CTA's share of the split tiles is at least SPLIT_MIN_BLOCKS K
# blocks. Measured (graphed): faster where the waves were 0.52-0.89 full (2048^2 with C 0.031
# against 0.034 ms persistent, 2048 x 8192 X X^T 0.080 against 0.101, 8 x 1024 x 5120 0.104 against
# 0.117, 5120^2 with C 0.250 against 0.268); slower at K = 12288 (see SPLIT_MAX_K), where the last
# wave was nearly full (3456 x 5120, 0.95: 0.127 against 0.116) and where a CTA's share was short
# (16 x 1024^2 with C, 22 blocks: 0.059 against 0.057; 1024^2, 4: 0.018 against 0.013).
SPLIT_MAX_FILL = 0.9
# 128 x 256 split lost to 128 x 128 split wherever the model would pick it (5120^2 with C 0.286 against
# 0.250 ms, 4096^2 0.150 against 0.133), 64 x 64 was not measured: both split only when asked
SPLIT_TILES = ((128, 128),)
SPLIT_MIN_BLOCKS = 32


def stream_k_pays(batch: int, m: int, k: int, shape: tuple[int, int], ctas_per_sm: Optional[int] = None) -> bool:
    """Whether the stream-K launch is expected to beat the persistent and per-tile ones (see
    SPLIT_MAX_FILL): single-CTA tiles whose last wave would leave SMs idle."""
    if shape not in SPLIT_TILES or k > SPLIT_MAX_K:
        return False
    ctas = persistent_ctas(shape, ctas_per_sm)
    tiles = batch * tile_count(m, *shape)
    waves = -(-tiles // ctas)
    split_tiles = tiles - max(waves - 2, 0) * ctas  # the last one or two waves' (kernel.SymmGemmSm90.stream_k_split)
    k_blocks = -(-k // TILE_K)
    return tiles < SPLIT_MAX_FILL * waves * ctas and split_tiles * k_blocks >= SPLIT_MIN_BLOCKS * ctas


# --------------------------------------------------------------------------------------------
# The launch of one product.


@dataclass(frozen=True)
class LaunchChoice:
    """How one product launches: output ``tile``, CTAs per SM, ``persistent`` (one CTA per SM
    walking the tiles) and ``stream_k`` (a persistent launch whose last waves split along K)."""

    tile: tuple[int, int]
    ctas_per_sm: int
    persistent: bool
    stream_k: bool


def choose_launch(
    batch: int,
    m: int,
    k: int,
    float32_out: bool,
    c_differs: bool,
    config: KernelConfig,
    tile=None,
    persistent: Optional[bool] = None,
    stream_k: Optional[bool] = None,
    ctas_per_sm: Optional[int] = None,
) -> LaunchChoice:
    """The launch of a (batch, m, k) product: what the caller asks for (``tile``, ``persistent``,
    ``stream_k``, ``ctas_per_sm``), else the configuration's, else the tile model's. The persistent
    launch stages the tile, and C, in the output dtype: a ``float32_out`` product, or one whose C
    ``c_differs`` from the output dtype, runs one CTA per tile (and never splits)."""
    shape = kernel_config.tile_shape(tile or config.tile or default_tile(m, batch, k, config.stream_k is not False))
    ctas_per_sm = checked_ctas_per_sm(*shape, ctas_per_sm)
    if persistent is None:
        persistent = config.persistent
    can_persist = not float32_out and not c_differs
    can_split = can_persist and persistent is not False and CLUSTER_M.get(shape, 1) == 1
    if stream_k and not can_split:
        raise ValueError(
            f"stream_k needs the persistent launch of a single-CTA tile; this product (tile "
            f"{shape[0]}x{shape[1]}, float32 out {float32_out}, C of another dtype {c_differs}, "
            f"persistent {persistent}) cannot take it"
        )
    if stream_k is None:
        stream_k = config.stream_k
        if stream_k is None:
            stream_k = can_split and stream_k_pays(batch, m, k, shape, ctas_per_sm)
        stream_k = stream_k and can_split
    if persistent is None:
        persistent = stream_k or persistent_pays(batch, m, shape, ctas_per_sm)
    return LaunchChoice(shape, ctas_per_sm, persistent and can_persist, stream_k)
