"""The convergence benchmark's corpus: the source code this Python installation already holds.

No download: every source file (``SUFFIXES``) under the interpreter's standard library and its
site-packages, read as bytes (vocabulary 256). Deterministic: files are ordered by a hash of their
path relative to its root, identical contents are kept once, and the result's SHA-256 is recorded
with every run, so two results merge only when they trained on the same bytes. About one file in
``VAL_EVERY`` (chosen by the same hash) is held out for validation.

A run never sees a byte twice: the training bytes are cut into ``batch`` equal lanes, and step s
reads window s of every lane (see :func:`lane_starts`); a run that would need more bytes than a
lane holds is refused before it starts.
"""

from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SUFFIXES = (".py", ".pyi", ".pyx", ".pxd", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".inl")
MAX_FILE_BYTES = 4 << 20  # larger files are generated tables, not source
VAL_EVERY = 200  # one file in VAL_EVERY (by path hash) is held out


@dataclass
class Corpus:
    train: torch.Tensor  # uint8
    val: torch.Tensor  # uint8
    sha256: str  # of train + val, as they are ordered here
    files: int

    @property
    def bytes(self) -> int:
        return self.train.numel() + self.val.numel()


def source_roots(stdlib_only: bool = False) -> list[Path]:
    """The standard library and every site-packages folder, each once (nested ones dropped); with
    ``stdlib_only`` the standard library's folder alone (as the interpreter lays it out)."""
    candidates = [sysconfig.get_paths()["stdlib"]]
    if not stdlib_only:
        candidates += [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        candidates += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    roots: list[Path] = []
    for path in sorted({Path(c).resolve() for c in candidates if c and Path(c).is_dir()}, key=lambda p: len(p.parts)):
        if not any(root in path.parents for root in roots):
            roots.append(path)
    return roots


def _path_key(root_index: int, relative: str) -> bytes:
    return hashlib.sha256(f"{root_index}:{relative}".encode()).digest()


def list_sources(roots: list[Path]) -> list[tuple[bytes, Path]]:
    """(hash key, path) of every source file under ``roots``, ordered by the key."""
    found = []
    for index, root in enumerate(roots):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in filenames:
                if name.endswith(SUFFIXES):
                    path = Path(dirpath, name)
                    relative = str(path.relative_to(root))
                    found.append((_path_key(index, relative), path))
    found.sort(key=lambda item: item[0])
    return found


def build(min_bytes: int = 0, roots: list[Path] | None = None, max_bytes: int | None = None) -> Corpus:
    """Read the corpus (up to ``max_bytes``); ValueError if it holds fewer than ``min_bytes``."""
    roots = roots if roots is not None else source_roots()
    train_parts, val_parts, seen = [], [], set()
    total, files = 0, 0
    digest = hashlib.sha256()
    for key, path in list_sources(roots):
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            if path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            data = path.read_bytes()
        except OSError:
            continue
        content = hashlib.sha256(data).digest()
        if not data or content in seen:
            continue
        seen.add(content)
        (val_parts if int.from_bytes(key[:4], "big") % VAL_EVERY == 0 else train_parts).append(data)
        total += len(data)
        files += 1
    train, val = b"".join(train_parts), b"".join(val_parts)
    digest.update(train)
    digest.update(val)
    if total < min_bytes:
        raise ValueError(
            f"the corpus under {[str(r) for r in roots]} has {total:,} bytes; {min_bytes:,} are needed "
            "(fewer steps, a smaller batch, or more packages installed)"
        )
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
    return Corpus(as_tensor(train), as_tensor(val), digest.hexdigest(), files)


def save(corpus: Corpus, path: str) -> None:
    torch.save({"train": corpus.train, "val": corpus.val, "sha256": corpus.sha256, "files": corpus.files}, path)


def load(path: str) -> Corpus:
    saved = torch.load(path)
    return Corpus(saved["train"], saved["val"], saved["sha256"], saved["files"])


def lane_starts(n_train: int, batch: int, seq: int, steps: int, seed: int) -> torch.Tensor:
    """(steps, batch) window starts that read every training byte at most once.

    Lane j is bytes [j L, (j + 1) L) with L = n_train // batch; step s reads window s of each lane,
    the lane's windows starting at an offset set by ``seed`` and wrapping around inside the lane.
    A window of ``seq`` inputs predicts ``seq`` targets, so a lane holds L - 1 targets; the run
    needs steps * seq of them.
    """
    lane = n_train // batch
    if steps * seq > lane - 1:
        raise ValueError(
            f"{steps} steps x {batch} lanes x {seq} bytes need {steps * seq * batch + batch:,} training "
            f"bytes without repeats; the corpus has {n_train:,}"
        )
    usable = (lane - 1) // seq * seq  # whole windows per lane
    offset = (seed * 7919 * seq) % usable
    local = (offset + torch.arange(steps) * seq) % usable  # (steps,) inside the lane
    return local.unsqueeze(1) + torch.arange(batch).unsqueeze(0) * lane


def val_starts(n_val: int, seq: int, count: int) -> torch.Tensor:
    """``count`` evenly spaced held-out window starts."""
    if n_val < seq + 2:
        raise ValueError(f"the held-out split has {n_val} bytes, shorter than one window of {seq}")
    return torch.linspace(0, n_val - seq - 1, count).long()
