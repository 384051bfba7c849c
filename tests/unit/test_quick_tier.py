"""The quick tier's rules (tests/support/quick_tier.py): a test outside ``slow`` that starts a
process, or takes over a second less its waits for a core, fails naming what it did."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.multiprocessing as torch_mp

from support import quick_tier
from support.repository import TESTS


class NotStarted(Exception):
    """What the stand-in of a process start raises: nothing was started."""


def _refuse(*args, **kwargs):
    raise NotStarted


def _noop(rank: int) -> None:
    pass


def _starts(monkeypatch, start) -> list[str]:
    """What recording_process_starts records of ``start()``, every way of starting a process
    replaced by a stand-in that starts nothing."""
    for owner, name, _ in quick_tier.START_POINTS:
        monkeypatch.setattr(owner, name, _refuse)
    with quick_tier.recording_process_starts() as starts:
        with pytest.raises(NotStarted):
            start()
    return list(starts)


@pytest.mark.parametrize(
    "start, recorded",
    [
        (lambda: subprocess.run(["echo", "hi"]), "subprocess echo hi"),
        (lambda: os.popen("echo hi"), "subprocess echo hi"),
        (lambda: torch_mp.spawn(_noop, nprocs=2), "multiprocessing "),
        (lambda: multiprocessing.get_context("fork").Process(target=_noop, args=(0,)).start(), "multiprocessing "),
        (lambda: os.system("true"), "os.system"),
        (lambda: os.fork(), "os.fork"),
        (lambda: os.posix_spawn("/bin/true", ["true"], os.environ), "os.posix_spawn"),
    ],
    ids=["subprocess", "os.popen", "torch.multiprocessing.spawn", "multiprocessing", "os.system", "os.fork", "os.posix_spawn"],
)
def test_every_way_of_starting_a_process_is_recorded(monkeypatch, start, recorded):
    [start_seen] = _starts(monkeypatch, start)
    assert start_seen.startswith(recorded), start_seen


def test_the_original_start_points_come_back():
    before = [vars(owner)[name] for owner, name, _ in quick_tier.START_POINTS]
    with quick_tier.recording_process_starts():
        assert all(vars(owner)[name] is not b for (owner, name, _), b in zip(quick_tier.START_POINTS, before))
    assert [vars(owner)[name] for owner, name, _ in quick_tier.START_POINTS] == before


def _phase_of(record: quick_tier.Record, clock: list[float], waited: list[float], wall: float, waiting: float) -> None:
    with record.phase():
        clock[0] += wall
        waited[0] += waiting


def test_a_test_is_timed_less_its_waits_for_a_core_over_its_phases():
    clock, waited = [100.0], [7.0]
    record = quick_tier.Record(clock=lambda: clock[0], waited=lambda: waited[0])
    _phase_of(record, clock, waited, wall=0.2, waiting=0.0)  # setup
    _phase_of(record, clock, waited, wall=3.0, waiting=2.5)  # call: a loaded machine
    assert record.seconds == pytest.approx(0.7) and record.breaches() == []
    _phase_of(record, clock, waited, wall=0.4, waiting=0.0)  # teardown
    [breach] = record.breaches()
    assert breach == "took 1.10 s less its waits for a core, over the quick tier's 1 s: mark it slow or make it quicker"


def test_loading_a_module_for_the_first_time_is_not_the_test_s_time_nor_its_process_starts(tmp_path, monkeypatch):
    name = f"quick_tier_fresh_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text("import subprocess, time\ntime.sleep(0.3)\nsubprocess.run(['true'], check=True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    record = quick_tier.Record()
    with record.phase():
        importlib.import_module(name)
        time.sleep(0.05)
    assert record.importing >= 0.3 and 0.05 <= record.seconds < 0.2 and record.starts == [], (record.importing, record.seconds)
    with record.phase():  # imported already: nothing to load
        importlib.import_module(name)
    assert record.importing < 0.4 and record.breaches() == []


def test_torch_runs_on_one_thread_while_a_test_is_timed():
    torch.set_num_threads(2)  # restored by this test's own timed phase
    record = quick_tier.Record()
    with record.phase():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("content, seconds", [("1200 2500000000 7\n", 2.5), ("", 0.0)])
def test_the_wait_for_a_core_is_read_from_schedstat(tmp_path, content, seconds):
    (tmp_path / "schedstat").write_text(content)
    assert quick_tier.waited_for_a_core_s(str(tmp_path / "schedstat")) == seconds
    assert quick_tier.waited_for_a_core_s(str(tmp_path / "absent")) == 0.0


def test_the_suite_runs_under_the_rules(request):
    assert request.config.pluginmanager.get_plugin("quick_tier") is quick_tier


_INNER = r"""
import os, subprocess, sys, time

import pytest
import torch
import torch.distributed.run
import torch.multiprocessing


def busy(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def noop(rank):
    pass


def test_quick():
    busy(0.05)


def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_spawn():
    torch.multiprocessing.spawn(noop, nprocs=1)


def test_torchrun(tmp_path):
    (tmp_path / "w.py").write_text("pass")
    torch.distributed.run.main(["--standalone", "--nproc-per-node", "1", str(tmp_path / "w.py")])


@pytest.fixture
def slow_setup():
    busy(1.2)


def test_over_a_second_in_its_setup(slow_setup):
    pass


def test_over_a_second():
    busy(1.2)


def test_a_first_import_over_a_second(tmp_path, monkeypatch):
    (tmp_path / "slow_to_import.py").write_text("import time\nend = time.thread_time() + 1.2\nwhile time.thread_time() < end:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_to_import  # noqa: F401


@pytest.mark.slow
def test_marked_slow():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    busy(1.2)


@pytest.mark.gpu
def test_marked_gpu():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


@pytest.mark.slow
def test_a_test_outside_slow_fails_for_a_process_or_over_a_second_and_says_so(tmp_path):
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(_INNER))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    gpu: gpu\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "support.quick_tier", "test_inner.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    outcomes = {
        line.split()[1].split("::")[1]: line.split()[0]
        for line in out.stdout.splitlines()
        if line.split()[:1] in (["PASSED"], ["FAILED"], ["ERROR"])
    }
    assert outcomes == {
        "test_quick": "PASSED",
        "test_subprocess": "FAILED",
        "test_spawn": "FAILED",
        "test_torchrun": "FAILED",
        "test_over_a_second_in_its_setup": "ERROR",
        "test_over_a_second": "FAILED",
        "test_a_first_import_over_a_second": "PASSED",
        "test_marked_slow": "PASSED",
        "test_marked_gpu": "PASSED",
    }, out.stdout[-6000:] + out.stderr[-3000:]
    for name, says in (
        ("test_subprocess", f"started 1 process(es): subprocess {sys.executable} -c pass"),
        ("test_spawn", "started 1 process(es): multiprocessing "),
        ("test_torchrun", "started "),
        ("test_over_a_second", "took 1.2"),
    ):
        assert f"test_inner.py::{name} is in the quick tier (not marked slow) but {says}" in out.stdout, out.stdout[-6000:]
