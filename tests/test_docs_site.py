"""The documentation site builds with ``mkdocs build --strict`` (every page in the navigation, every
link and anchor resolved, the API pages read from the source without importing the package)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "megatron" / "index.html").read_text(encoding="utf-8")
    assert 'id="dion3_megatron.megatron.MegatronDion3"' in api and 'id="dion3_megatron.megatron.register"' in api
