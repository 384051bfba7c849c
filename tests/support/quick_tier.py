"""A pytest plugin (tests/conftest.py registers it) that holds the quick tier to its two rules:
a test marked neither ``slow`` nor ``gpu`` starts no process and takes at most a second, or fails
saying which rule it broke.

A process start is any of the ways Python starts one: ``subprocess`` (and ``os.popen``),
``multiprocessing`` and ``torch.multiprocessing`` (every start method, their helper processes
included), ``torchrun`` in the process (its agent starts workers by one of those), ``os.fork``,
``os.system`` and ``os.posix_spawn``. Each start is recorded and let run; the test fails afterwards
naming them. A process a module starts while it is first imported (Megatron-Core runs git) is the
import's, not the test's.

A test's time is that of its setup, call and teardown, less what does not depend on the test:
the time its thread waited for a core (Linux's ``/proc/thread-self/schedstat``; where that file is
missing, nothing), so that the rule holds on a shared, loaded machine, and the time it spent loading
modules that no test had imported yet, a cost of the process that whichever test imports a
framework first would pay (collection pays most of it). Torch runs on one thread meanwhile, so that
no other thread's wait for a core stretches the test's (its thread would wait on it without
queueing for a core).
"""

from __future__ import annotations

import contextlib
import importlib._bootstrap
import multiprocessing.process
import multiprocessing.util
import os
import subprocess
import time
from typing import Any, Callable, Iterator

import pytest
import torch

LIMIT_S = 1.0
SCHEDSTAT = "/proc/thread-self/schedstat"  # time on a core, time waiting for one (ns), time slices


def applies_to(keywords: Any) -> bool:
    """The rules hold for a test marked neither ``slow`` (multi-process runs and tests over a second)
    nor ``gpu`` (timed on the GPU machine, which runs them with ``-m gpu``)."""
    return "slow" not in keywords and "gpu" not in keywords


def waited_for_a_core_s(schedstat: str = SCHEDSTAT) -> float:
    """Seconds this thread has waited for a core since it started; 0.0 where Linux does not say."""
    try:
        with open(schedstat) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class ProcessStarts(list):
    """The process starts seen, one entry per start (a start made inside another, such as
    multiprocessing's helper for a spawned process, is part of that one)."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0

    def recording(self, original: Callable, describe: Callable[..., str]) -> Callable:
        """``original``, appending ``describe(*its arguments)`` to this list at each outermost call."""

        def start(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.append(describe(*args, **kwargs)[:200])
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return start

    @contextlib.contextmanager
    def ignored(self) -> Iterator[None]:
        """A block whose process starts are not recorded."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


def _command(popen: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> str:
    return f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))}"


def _process(process: multiprocessing.process.BaseProcess) -> str:
    return f"multiprocessing {process.name} (target {getattr(process, '_target', None)!r})"


def _os_call(name: str) -> Callable[..., str]:
    return lambda *args, **kwargs: f"os.{name}"


# Where a process starts: (owner, attribute, what a start there is called).
START_POINTS: tuple[tuple[Any, str, Callable[..., str]], ...] = (
    (subprocess.Popen, "_execute_child", _command),
    (multiprocessing.process.BaseProcess, "start", _process),
    (multiprocessing.util, "spawnv_passfds", lambda path, *args: f"multiprocessing helper {path}"),
    *((os, name, _os_call(name)) for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp") if hasattr(os, name)),
)


@contextlib.contextmanager
def recording_process_starts() -> Iterator[ProcessStarts]:
    """A block in which every process start is let run and recorded in the list it yields."""
    starts = ProcessStarts()
    originals = [(owner, name, vars(owner)[name]) for owner, name, _ in START_POINTS]
    for (owner, name, describe), (_, _, original) in zip(START_POINTS, originals):
        setattr(owner, name, starts.recording(original, describe))
    try:
        yield starts
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


class Record:
    """One test's process starts and its time (wall time less the time waited for a core and the
    time spent loading modules for the first time), summed over its phases; ``clock`` and
    ``waited`` are those two clocks, in seconds."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, waited: Callable[[], float] = waited_for_a_core_s) -> None:
        self.starts: list[str] = []
        self.seconds = 0.0
        self.importing = 0.0  # of which: loading modules for the first time (not counted in seconds)
        self.reported = False
        self._clock, self._waited = clock, waited

    def _ran(self, start: tuple[float, float]) -> float:
        """Seconds since ``start`` (clock, waited) less the waits for a core."""
        return (self._clock() - start[0]) - (self._waited() - start[1])

    @contextlib.contextmanager
    def _timing_first_imports(self, starts: ProcessStarts) -> Iterator[None]:
        """importlib's loading of a module not yet in sys.modules, timed (the outermost load only:
        a module's own imports are part of its load), its process starts not recorded."""
        original = importlib._bootstrap._find_and_load  # type: ignore[attr-defined]
        depth = 0

        def find_and_load(name: str, import_: Callable) -> Any:
            nonlocal depth
            start = (self._clock(), self._waited())
            depth += 1
            try:
                with starts.ignored():
                    return original(name, import_)
            finally:
                depth -= 1
                if depth == 0:
                    self.importing += self._ran(start)

        importlib._bootstrap._find_and_load = find_and_load  # type: ignore[attr-defined]
        try:
            yield
        finally:
            importlib._bootstrap._find_and_load = original  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def phase(self) -> Iterator[None]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # no thread of torch's waits for a core while this one is timed
        start, importing = (self._clock(), self._waited()), self.importing
        with recording_process_starts() as starts, self._timing_first_imports(starts):
            try:
                yield
            finally:
                self.seconds += self._ran(start) - (self.importing - importing)
                self.starts += starts
                torch.set_num_threads(threads)

    def breaches(self) -> list[str]:
        """What the test did against the quick tier's rules."""
        found = []
        if self.starts:
            listed = "; ".join(self.starts[:3]) + (f"; and {len(self.starts) - 3} more" if len(self.starts) > 3 else "")
            found.append(f"started {len(self.starts)} process(es): {listed}")
        if self.seconds > LIMIT_S:
            found.append(f"took {self.seconds:.2f} s less its waits for a core, over the quick tier's {LIMIT_S:g} s")
        if found:
            found[-1] += ": mark it slow or make it quicker"
        return found


_RECORD = pytest.StashKey[Record]()


def _checked_phase(item: pytest.Item) -> Any:
    """One phase (setup, call or teardown) of a test the rules hold for, recorded; the phase fails
    at the test's first breach."""
    if not applies_to(item.keywords):
        return (yield)
    record = item.stash.setdefault(_RECORD, Record())
    with record.phase():
        result = yield
    breaches = record.breaches()
    if breaches and not record.reported:
        record.reported = True
        pytest.fail(f"{item.nodeid} is in the quick tier (not marked slow) but {' and '.join(breaches)}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    return (yield from _checked_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    return (yield from _checked_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    return (yield from _checked_phase(item))
