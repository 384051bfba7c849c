"""Running the examples' shell scripts with a python3 that only records its arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run_recording_python(script: Path, tmp_path: Path, env: dict, runs_exit: int = 0, results: bool = True) -> subprocess.CompletedProcess:
    """``bash script`` in tmp_path with ``env`` and a python3 first on PATH that runs nothing and
    appends its arguments to tmp_path/launched, one line per call (absent if nothing was launched);
    the training runs (torch.distributed.run) exit with ``runs_exit``. Results go to
    tmp_path/results, or with ``results=False`` where the script puts them by default."""
    run_env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", **env)
    run_env.pop("RESULTS", None)
    if results:
        run_env["RESULTS"] = str(tmp_path / "results")
    (tmp_path / "python3").write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/launched\ncase "$*" in *torch.distributed.run*) exit {runs_exit} ;; esac\n'
    )
    (tmp_path / "python3").chmod(0o755)
    return subprocess.run(["bash", str(script)], cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=60)
