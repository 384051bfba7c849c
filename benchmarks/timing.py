"""Timing helpers shared by the GPU benchmarks: CUDA events, warm-up, medians."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured in a CUDA graph (after warm-up calls on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def cuda_median_ms(fn: Callable[[int], object], n_sets: int = 1, iters: int = 1, reps: int = 5, warmup: int = 2,
                   graph: bool = False) -> float:
    """Median milliseconds per call of ``fn(i)`` over ``reps`` timed runs of ``iters`` calls each,
    rotating ``i`` over ``n_sets`` input sets (so repeated calls do not just measure the cache).
    ``graph``: each ``fn(i)`` captured in a CUDA graph and replayed (the host's launch cost out, as
    inside a graphed optimizer step)."""
    if graph:
        replays = [graphed(lambda i=i: fn(i)) for i in range(n_sets)]
        return cuda_median_ms(lambda i: replays[i](), n_sets, iters, reps, warmup)
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
