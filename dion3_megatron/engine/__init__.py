"""The Dion3 step of any layout: each rank passes its pieces of the logical matrices
(:class:`MatrixShard`, placed by a :class:`Sharding`; whole matrices are ``Sharding.full()``
shards), the plan groups them by shape (:mod:`.plan`), and every shape group steps through one
exchange (:mod:`.exchange`, :mod:`.local`, :mod:`.static`, :mod:`.planned`, :mod:`.general`),
the whole step replayed from a CUDA graph where it can be (:mod:`.cuda_graph`).
"""

from .engine import Dion3Engine
from .sharding import MatrixShard, Rect, Sharding

__all__ = ["Dion3Engine", "MatrixShard", "Rect", "Sharding"]
