"""A training corpus that needs no download: the running Python's standard-library sources, as
bytes or as byte-level tokens."""

from __future__ import annotations

import pathlib
import sysconfig

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
