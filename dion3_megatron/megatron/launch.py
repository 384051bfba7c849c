"""Run a Megatron-LM training script with Dion3 registered.

    python -m dion3_megatron.megatron.launch pretrain_gpt.py --optimizer dion3 --dion3-fraction 0.25 ...
    torchrun --nproc-per-node 8 -m dion3_megatron.megatron.launch pretrain_gpt.py ...

The script runs as ``__main__`` with ``sys.argv = [script, *args]``, exactly as ``python script``
would run it, after :func:`dion3_megatron.megatron.register`.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script, args = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"dion3_megatron.megatron.launch: no such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    from . import register

    register()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
