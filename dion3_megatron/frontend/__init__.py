"""What every front end needs besides the engine: the lifecycle every Dion3 optimizer class shares
(:mod:`.lifecycle`: the step's one decision, the skip counter, the automatic-f record, loading), a
parameter as matrices (:mod:`.matrices`), the non-finite gate (:mod:`.gate`), param groups and
checkpoint checks of the front ends that hold parameters whole (:mod:`.groups`), and their step
through the engine (:mod:`.whole`). The torch, Megatron and DeepSpeed front ends only translate
their framework's layout into engine shards.
"""

from .gate import announce_skipped_step, gradients_usable, usable_on_every_rank
from .matrices import matrix_count, matrix_shape, matrix_values, matrix_view, stacked_view

__all__ = [
    "announce_skipped_step",
    "gradients_usable",
    "matrix_count",
    "matrix_shape",
    "matrix_values",
    "matrix_view",
    "stacked_view",
    "usable_on_every_rank",
]
