"""Put into a virtualenv's site-packages the given distributions and everything they require (their
extras' requirements included), as symbolic links to the files of this interpreter's installation
of them, each distribution's own as its RECORD lists them (its metadata included, so pip and
importlib.metadata see it installed; its scripts left out).

The virtualenv then holds exactly those distributions, installed once: CI tests the built wheel
beside torch's CUDA build without a second download of it, and without the frameworks of the first
virtualenv (Megatron-Core, DeepSpeed, transformers) in sight.

    python .ci/linked_venv.py VENV torch pytest numpy
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

from packaging.requirements import Requirement


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def required(names: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """The distributions named and all they require here, by canonical name: each requirement whose
    marker holds on this interpreter, for the distribution itself and for each of its extras asked for."""
    found: dict[str, importlib.metadata.Distribution] = {}
    extras: dict[str, set[str]] = {}
    pending = [Requirement(name) for name in names]
    while pending:
        requirement = pending.pop()
        key = canonical(requirement.name)
        asked = {""} | set(requirement.extras)
        if key in found and asked <= extras[key]:
            continue
        found[key] = importlib.metadata.distribution(requirement.name)
        extras[key] = extras.get(key, set()) | asked
        for text in found[key].requires or []:
            needed = Requirement(text)
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra}) for extra in extras[key]):
                pending.append(needed)
    return found


def link(distribution: importlib.metadata.Distribution, site: pathlib.Path) -> int:
    """Link the files of ``distribution`` under site-packages into ``site``; returns how many."""
    count = 0
    for file in distribution.files or []:
        if file.parts[0] == "..":  # a script in bin/: it would run the first virtualenv's python
            continue
        source, target = pathlib.Path(distribution.locate_file(file)), site / file
        if not source.exists() or target.exists():  # a .pyc never written; a namespace package's shared file
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(source, target)
        count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=pathlib.Path, help="the virtualenv to fill (made with the same Python)")
    parser.add_argument("names", nargs="+", help="distributions, e.g. torch pytest numpy")
    args = parser.parse_args()
    script = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = pathlib.Path(subprocess.check_output([str(args.venv / "bin" / "python"), "-c", script], text=True).strip())
    distributions = required(args.names)
    files = sum(link(distribution, site) for distribution in distributions.values())
    print(f"linked {len(distributions)} distributions ({files} files) into {site}: {', '.join(sorted(distributions))}", file=sys.stderr)


if __name__ == "__main__":
    main()
