"""Which kernels run: one configuration object for the process, read at every dispatch.

:class:`KernelConfig` holds every switch the kernels have: ``kernels`` ("auto": the package's
kernels where they pay, "torch": plain torch everywhere), a forced matmul ``backend`` (tests and
benchmarks), the routing rule and thresholds of the symmetric-GEMM kernels, their tile, and the
Triton row kernels. Environment variables are only defaults (``DION3_KERNELS=0``: kernels
"torch"; ``DION3_FUSED_ROWS=0``: no row kernels), read when no configuration was set, at each
read, so nothing freezes at import or first use. A Dion3 optimizer's ``kernels`` option applies
its value for the duration of its steps (:func:`scoped_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

KERNELS = ("auto", "torch")
ROUTINGS = ("measured", "always")
TILES = ((64, 64), (128, 128), (128, 256), (256, 128), (256, 256))  # (tile_m, tile_n) of the symmetric GEMM kernels
# Block rows per band of the symmetric GEMM's tile order (symm.kernel.SymmGemmSm90.block_coord): the
# CTAs running at once share their operand panels in L2; 1: the triangle row by row. 8 cut the DRAM
# traffic of Gram NS's products by about a third and the symmetric products' time by up to 8%
# (8192^2 X X^T at 128 x 256 tiles), the whole step unchanged.
DEFAULT_TILE_GROUP = 8


def tile_shape(tile) -> tuple[int, int]:
    """(tile_m, tile_n) from 64, 128, 256, (128, 256) or "128x256"."""
    if isinstance(tile, str):
        tile = tuple(int(v) for v in tile.split("x")) if "x" in tile else int(tile)
    shape = (tile, tile) if isinstance(tile, int) else tuple(tile)
    if shape not in TILES:
        raise ValueError(f"tile must be one of {[f'{m}x{n}' for m, n in TILES]}, got {tile!r}")
    return shape


def checked_tile_group(value: Any) -> int:
    """``value`` if it is a valid tile_group (an int >= 1), else a ValueError naming it."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"tile_group must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class KernelConfig:
    """The kernels' switches, one frozen value: ``kernels`` ("auto" | "torch"), a forced matmul
    ``backend``, the ``routing`` of the symmetric GEMMs and its thresholds (``min_tiles``,
    ``min_width``), their ``tile``, ``persistent`` and ``stream_k`` launches and ``tile_group``, and
    the Triton row kernels (``fused_rows``). [`configure`][dion3_megatron.kernels.configure] sets it
    for the process, [`using`][dion3_megatron.kernels.using] for a block;
    [`current`][dion3_megatron.kernels.current] is the one in force."""

    kernels: str = "auto"
    backend: Optional[str] = None  # a registered matmul backend forced for every product (kernels.dispatch)
    routing: str = "measured"  # "always": every product the symmetric kernels can take (tests, benchmarks)
    # A product goes to the kernel when it fills the GPU: batch x its output tiles that meet the
    # lower triangle (counted in 128 x 256 tiles, symm.heuristics.ROUTING_TILE) at least min_tiles,
    # one wave of an H200's 132 SMs. Measured (H200, CuTe DSL 4.8.1, torch 2.11 cuBLAS): below a wave
    # the kernel lost to cuBLAS's full product (1024 x 5120, 20 tiles; 2048 x 8192, 72 tiles: 0.88x),
    # from one on it won (3072^2, 156 tiles: 1.02x; 16 x 1024 x 5120, 320 tiles: Gram NS 2.85 ms
    # against 3.18 with cuBLAS, graphed).
    min_tiles: int = 132
    # Below min_tiles, a product at least min_width wide goes to the kernel too where stream-K may
    # run (stream_k not False, K at most symm.heuristics.SPLIT_MAX_K), which spreads its one wave's
    # tiles over every SM along K. Measured (H200, graphed): 2048 x 8192 X X^T 1.13-1.15x of cuBLAS,
    # the 2048^2 products of Gram NS with their addend 1.16-1.17x (72 tiles each); 1024-wide
    # products stay slower (1024 x 5120 0.72-0.75x). The same routing holds eager: there the
    # kernel's launch costs less host time than cuBLAS's, and each routed product measured at
    # least as fast as cuBLAS (benchmarks/bench_eager.py; benchmarks/results/eager-launch-h200.json).
    min_width: int = 2048
    tile: Any = None  # symmetric-GEMM tile, any form tile_shape takes; None: modelled per shape (symm.heuristics.default_tile)
    # symmetric-GEMM launch: one CTA per SM walking the tiles, each tile stored by warps that do
    # no MMAs while the next one computes (symm.kernel.SymmGemmSm90), instead of one CTA per tile
    # whose consumers store it. None: where one CTA per tile would take at least two waves of
    # CTAs (symm.heuristics.persistent_pays; a CTA then walks several tiles). Measured on an H200:
    # the products of 2+ waves faster, a batch of 8 x 1024^2 (1.2 waves)
    # slower; with this rule the 14B-shape step 3.1% faster at f = 1 than with False
    persistent: Optional[bool] = None
    # stream-K: a persistent launch of single-CTA tiles that splits the tiles of its last waves
    # along K among all its CTAs (symm.kernel.SymmGemmSm90). None: where the last wave would leave
    # SMs idle and it measured faster (symm.heuristics.stream_k_pays), the launch then persistent; True:
    # wherever the launch can take it; False: never.
    stream_k: Optional[bool] = None
    fused_rows: bool = True  # the Triton row kernels (kernels/rows.py) where kernels is "auto"
    tile_group: int = DEFAULT_TILE_GROUP  # block rows per band of the symmetric GEMM's tile order
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)  # set in __post_init__

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        for name in ("min_tiles", "min_width"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.fused_rows, bool):
            raise ValueError(f"fused_rows must be a bool, got {self.fused_rows!r}")
        checked_tile_group(self.tile_group)
        for name in ("persistent", "stream_k"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool or None, got {value!r}")
        if self.tile is not None:  # one spelling, hashable: a configuration can key a cache or a graph
            object.__setattr__(self, "tile", tile_shape(self.tile))
        # hashed once: every kernel launch looks its configuration up in a cache
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.compare)))

    def __hash__(self) -> int:
        return self._hash


def from_environment() -> KernelConfig:
    """The defaults: DION3_KERNELS=0 -> kernels "torch"; DION3_FUSED_ROWS=0 -> no row kernels."""
    return _environment_config(os.environ.get("DION3_KERNELS", "1"), os.environ.get("DION3_FUSED_ROWS", "1"))


@functools.lru_cache(maxsize=None)
def _environment_config(kernels: str, fused_rows: str) -> KernelConfig:
    # Read at every dispatch (once per product in a step): the variables are read each time, the
    # validated configuration built once per combination of their values.
    return KernelConfig(kernels="torch" if kernels == "0" else "auto", fused_rows=fused_rows != "0")


_configured: Optional[KernelConfig] = None  # set by configure(); None: from_environment()
_scoped = threading.local()  # .stack: the configurations of the using() blocks this thread is in


def current() -> KernelConfig:
    """The configuration in force on this thread: the innermost
    [`using`][dion3_megatron.kernels.using] block's, else the process's
    ([`configure`][dion3_megatron.kernels.configure]), else the environment's."""
    stack = getattr(_scoped, "stack", None)
    if stack:
        return stack[-1]
    return _configured if _configured is not None else from_environment()


def configure(config: Optional[KernelConfig] = None, **changes: Any) -> KernelConfig:
    """Set the process's configuration: ``config``, or the current one with ``changes``
    (``configure(kernels="torch")``); ``configure(None)`` without changes returns to the
    environment's defaults. Returns the new configuration."""
    global _configured
    if config is None and not changes:
        _configured = None
        return current()
    _configured = _checked(dataclasses.replace(config or current(), **changes))
    return _configured


@contextlib.contextmanager
def _in_force(config: KernelConfig) -> Iterator[KernelConfig]:
    """A block (this thread only) under ``config``."""
    stack = _scoped.__dict__.setdefault("stack", [])
    stack.append(config)
    try:
        yield config
    finally:
        stack.pop()


@contextlib.contextmanager
def pinned() -> Iterator[KernelConfig]:
    """A block (this thread only) under the configuration in force now, read once: every read
    inside returns it at the cost of a thread-local lookup, without consulting the environment
    (an orthogonalization reads it for each of its products). Also a decorator: ``@pinned()``."""
    with _in_force(current()) as config:
        yield config


@contextlib.contextmanager
def using(config: Optional[KernelConfig] = None, **changes: Any) -> Iterator[KernelConfig]:
    """A block (this thread only) under ``config``, or the current configuration with ``changes``."""
    with _in_force(_checked(dataclasses.replace(config or current(), **changes))) as scoped:
        yield scoped


def _checked(config: KernelConfig) -> KernelConfig:
    """``config``, once its forced backend (if any) is known to be registered."""
    if config.backend is not None:
        from . import dispatch

        dispatch.check_backend_name(config.backend)
    return config


def row_kernels_enabled() -> bool:
    """Whether the Triton row kernels may run (where triton and a CUDA device are present): the
    current configuration's kernels is "auto" and its fused_rows is on."""
    config = current()
    return config.kernels == "auto" and config.fused_rows


def scoped_step(step: Callable) -> Callable:
    """Decorator of an optimizer's ``step``: run it under the optimizer's ``kernels`` option
    ("auto" | "torch"; None: the configuration in force, :func:`pinned` for the step), and only it."""

    @functools.wraps(step)
    def run(self, *args: Any, **kwargs: Any) -> Any:
        with pinned() if self.kernels is None else using(kernels=self.kernels):
            return step(self, *args, **kwargs)

    return run
