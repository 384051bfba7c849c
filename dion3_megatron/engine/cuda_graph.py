"""CUDA graphs for the parts of a Dion3 step that touch the same tensors every step and never wait.

On GPUs the step of many small matrices is bound by the host: each of its hundreds of small
kernels costs a few microseconds to launch. Where a step is static (the same state buffers and
weights, the same shapes and settings) and has no host synchronization, it is captured once as a
CUDA graph and then replayed with one launch. The only numbers that change from step to step, lr
and weight decay, reach the graph through a small device tensor refreshed before every replay
(:class:`rule.UpdateFactors` in tensor form), so a replay computes exactly what an eager step with
the same values computes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, Hashable, Optional

import torch

from ..core import rule
from ..core.rule import UpdateFactors
from ..kernels import config as kernel_config

WARMUP_CALLS = 2  # eager calls with a key before it is captured (lazy initialization happens there)


@functools.lru_cache(maxsize=256)
def baked_settings(hp: rule.Dion3Hyperparameters) -> rule.Dion3Hyperparameters:
    """What of ``hp`` a captured step bakes in (part of a capture key): all but lr and weight
    decay, which reach the graph as factors. Cached: callers build keys every step."""
    return dataclasses.replace(hp, lr=0.0, weight_decay=0.0)


def usable(device: torch.device) -> bool:
    """Graphs are captured on CUDA devices only."""
    return device.type == "cuda"


class StepGraph:
    """One step function, captured after :data:`WARMUP_CALLS` eager calls and replayed afterwards.

    ``key`` must name everything the step bakes in: the addresses of the tensors it reads and
    writes, their shapes, the settings other than the factors. A call with a different key drops
    the graph and starts over (eager, then a new capture), so a changed model or a loaded
    checkpoint can never replay into stale memory.
    """

    def __init__(self) -> None:
        self.key: Optional[Hashable] = None
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.factors: Optional[torch.Tensor] = None
        self._stream: Optional[torch.cuda.Stream] = None

    def run(self, key: Hashable, step: Callable[[torch.Tensor], None], factor_values: list[float], device: torch.device) -> None:
        """Run ``step(factors)``: eagerly while warming up, else by replaying its graph.

        ``factors`` is a (len(factor_values),) fp32 device tensor holding ``factor_values``.
        """
        # The kernel configuration decides which kernels the step launches: a change captures anew.
        key = (key, kernel_config.current())
        if key != self.key:
            self.key, self.calls, self.graph = key, 0, None
            self.factors = torch.empty(len(factor_values), dtype=torch.float32, device=device)
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device)
        factors, stream = self.factors, self._stream
        assert factors is not None and stream is not None  # made for the key above
        # A pinned source: the copy is queued, not waited for (the caching host allocator keeps
        # the buffer alive until the copy has run).
        factors.copy_(torch.tensor(factor_values, dtype=torch.float32).pin_memory(), non_blocking=True)
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
        elif self.calls <= WARMUP_CALLS:
            self._on_side_stream(lambda: step(factors))
        else:
            self.graph = torch.cuda.CUDAGraph()
            current = torch.cuda.current_stream(device)
            stream.wait_stream(current)
            with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
                step(factors)
            current.wait_stream(stream)
            self.graph.replay()

    def run_with_factors(
        self, key: Hashable, step: Callable[[list[UpdateFactors]], None], factors: list[UpdateFactors], device: torch.device
    ) -> None:
        """:meth:`run` for a step that takes one :class:`UpdateFactors` per batch of matrices: given
        as numbers here, the step receives them as views of the graph's device tensor."""
        sizes = [len(f.shrink) for f in factors]
        total = sum(sizes)
        starts = list(itertools.accumulate(sizes, initial=0))
        values = [v for f in factors for v in f.shrink] + [v for f in factors for v in f.coef]

        def unpacked(t: torch.Tensor) -> None:
            step([UpdateFactors(t[a:b], t[total + a : total + b]) for a, b in zip(starts, starts[1:])])

        self.run(key, unpacked, values, device)

    def _on_side_stream(self, fn: Callable[[], None]) -> None:
        """Warm-up calls run on the capture stream, so per-stream lazy state (cuBLAS workspaces)
        exists before the capture."""
        stream = self._stream
        assert stream is not None  # made by run()
        current = torch.cuda.current_stream(stream.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            fn()
        current.wait_stream(stream)
