"""Timing helpers shared by the benchmarks: CUDA events, warm-up, medians; the figures and the host
a record names."""

from __future__ import annotations

import platform
import statistics
from pathlib import Path
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


def cuda_median_ms(
    fn: Callable[[int], object], n_sets: int = 1, iters: int = 1, reps: int = 5, warmup: int = 2, graph: bool = False
) -> float:
    """Median milliseconds per call of ``fn(i)`` over ``reps`` timed runs of ``iters`` calls each,
    rotating ``i`` over ``n_sets`` input sets (so repeated calls do not just measure the cache).
    ``graph``: each ``fn(i)`` captured in a CUDA graph and replayed (the host's launch cost out, as
    inside a graphed optimizer step)."""
    return cuda_median_ms_interleaved({"": fn}, n_sets, iters, reps, warmup, graph)[""]


def cuda_median_ms_interleaved(
    fns: dict[str, Callable[[int], object]], n_sets: int = 1, iters: int = 1, reps: int = 5, warmup: int = 2, graph: bool = False
) -> dict[str, float]:
    """:func:`cuda_median_ms` of several variants, their timed runs interleaved (rep 1 of each,
    then rep 2 of each, ..., the order rotated every rep) so that a drift of the unlocked clocks
    reaches every variant alike: timed one after another, two variants running the same kernels
    differed by up to 9% on an H200. Returns name -> median ms per call."""
    if graph:
        fns = {name: graph_replays(fn, n_sets) for name, fn in fns.items()}
    for fn in fns.values():
        for i in range(warmup):
            fn(i % n_sets)
    torch.cuda.synchronize()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)  # each variant takes each place in the round: no one always runs first
        for name in names[shift:] + names[:shift]:
            times[name].append(_timed_run(fns[name], n_sets, iters))
    return {name: statistics.median(values) for name, values in times.items()}


def graph_replays(fn: Callable[[int], object], n_sets: int) -> Callable[[int], None]:
    """``fn(i)`` for each of the ``n_sets`` inputs captured in its own CUDA graph; returns i -> its replay."""
    replays = [graphed(lambda i=i: fn(i)) for i in range(n_sets)]
    return lambda i: replays[i]()


def _timed_run(fn: Callable[[int], object], n_sets: int, iters: int) -> float:
    """Milliseconds per call of ``iters`` calls of ``fn(i)``, rotating over ``n_sets``, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i % n_sets)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rounded(value: object, digits: int = 2) -> object:
    """``value`` with its floats at the precision printed (milliseconds, GiB, GiB/s): the figures
    the docs cite, as written."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    return value


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor())
