"""The time spent in a DeepSpeed optimizer's own step(), for the DeepSpeed and Hugging Face examples."""

from __future__ import annotations

import time
from typing import Any, Callable


class StepTimer:
    """Wall seconds inside ``optimizer.step()`` (with ZeRO: on the flat slices), summed until
    :meth:`take`: ZeRO calls it once per param group in one engine step. ``sync`` waits for the
    device before and after each call."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.seconds = 0.0

    def wrap(self, optimizer: Any) -> None:
        """Time ``optimizer.step`` from now on."""
        inner_step = optimizer.step

        def timed_step(*a, **k):
            self.sync()
            t = time.perf_counter()
            out = inner_step(*a, **k)
            self.sync()
            self.seconds += time.perf_counter() - t
            return out

        optimizer.step = timed_step

    def take(self) -> float:
        """The seconds summed since the last take(); the next sum starts at 0."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
