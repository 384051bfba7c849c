"""Running the examples' shell scripts with a python3 that only records its arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run_recording_python(script: Path, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    """``bash script`` with ``env`` and a python3 first on PATH that runs nothing and appends its
    arguments to tmp_path/launched, one line per call (absent if nothing was launched); results go
    to tmp_path/results."""
    run_env = dict(os.environ, RESULTS=str(tmp_path / "results"), PATH=f"{tmp_path}:{os.environ['PATH']}", **env)
    (tmp_path / "python3").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/launched\n")
    (tmp_path / "python3").chmod(0o755)
    return subprocess.run(["bash", str(script)], env=run_env, capture_output=True, text=True, timeout=60)
