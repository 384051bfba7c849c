"""Timing helpers shared by the GPU benchmarks: CUDA events, warm-up, medians."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def cuda_median_ms(fn: Callable[[int], object], n_sets: int = 1, iters: int = 1, reps: int = 5, warmup: int = 2) -> float:
    """Median milliseconds per call of ``fn(i)`` over ``reps`` timed runs of ``iters`` calls each,
    rotating ``i`` over ``n_sets`` input sets (so repeated calls do not just measure the cache)."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i % n_sets)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)
