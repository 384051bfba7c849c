"""The documentation site builds with ``mkdocs build --strict`` (every page in the navigation, every
link and anchor resolved, the API pages read from the source without importing the package)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    # The mkdocs command of the environment running the tests (the docs tools are not test dependencies).
    mkdocs = shutil.which("mkdocs", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed")
    build = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert build.returncode == 0, build.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "megatron" / "index.html").read_text(encoding="utf-8")
    assert 'id="dion3_megatron.megatron.MegatronDion3"' in api and 'id="dion3_megatron.megatron.register"' in api
