"""A training corpus that needs no download: the running Python's standard-library sources, as
bytes, as byte-level tokens, or as a JSON-lines file in the format of torchtitan's c4_test."""

from __future__ import annotations

import json
import os
import pathlib
import sysconfig
from collections.abc import Iterable

import torch


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's ``.py`` sources, top level first, then one level down, each level in
    sorted order (so every rank of a job reads the same files)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}")
    return files


def stdlib_bytes(max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of :func:`stdlib_files`, concatenated."""
    chunks, total = [], 0
    for path in stdlib_files():
        if total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)[:max_bytes]


def byte_tokens(data: bytes) -> torch.Tensor:
    """``data`` as 1-D int64 tokens, one per byte (vocab 256)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def stdlib_tokens(max_bytes: int) -> torch.Tensor:
    """:func:`stdlib_bytes` as 1-D int64 tokens, one per byte (vocab 256)."""
    return byte_tokens(stdlib_bytes(max_bytes))


def write_stdlib_corpus(folder: pathlib.Path) -> pathlib.Path:
    """:func:`stdlib_files` as JSON lines ``{"text": ...}``, one file a line, in ``folder/data.json``:
    a dataset torchtitan's ``c4_test`` loader reads. Written once (:func:`write_once`)."""
    write_once(folder / "data.json", (json.dumps({"text": path.read_text(errors="replace")}) + "\n" for path in stdlib_files()))
    return folder


def write_once(path: pathlib.Path, lines: Iterable[str]) -> None:
    """``lines`` to ``path`` unless it is there. Processes that write it at once (a job's ranks)
    each write a file of their own beside ``path``'s folder, then rename it to ``path``: a reader
    of the folder never sees a partial file."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent.parent / f".{path.parent.name}-{path.name}.{os.getpid()}"
    with open(partial, "w") as f:
        f.writelines(lines)
    os.replace(partial, path)
