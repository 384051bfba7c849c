"""Run a Megatron-LM training script with ``--optimizer dion3`` registered.

    python -m dion3_megatron.megatron.launch pretrain_gpt.py --optimizer dion3 --dion3-fraction 0.25 ...
    torchrun --nproc-per-node 8 -m dion3_megatron.megatron.launch pretrain_gpt.py ...

The script runs as ``__main__`` with ``sys.argv = [script, *args]``, as ``python script`` would run
it, after [`dion3_megatron.megatron.register`][] (``launcher=True``: with ``LAUNCHER``, the one
change that only the launcher makes, ``skip_compile_helpers``);
started without torchrun, it runs as the one process of a one-process world (what
``torchrun --nproc-per-node 1`` would set up). ``--help`` (alone) prints the usage
and the ``--dion3-*`` flags without importing Megatron; ``SCRIPT --help`` prints the script's own
help, Megatron-LM's flags and the Dion3 group together.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import MutableMapping
from typing import Any, NoReturn

from .. import compat
from .registry import MCORE_019

PROG = "python -m dion3_megatron.megatron.launch"

_DESCRIPTION = """\
Run a Megatron-LM training script with --optimizer dion3 registered: the script runs as __main__
with the arguments after it, as "python SCRIPT ARGS" would run it (without torchrun, as a world of
one process, as "torchrun --nproc-per-node 1" would start it). Megatron-LM's
pretrain_gpt.py comes with Megatron-LM (the megatron-core wheel has none);
examples/megatron_lm_pretrain_gpt.py of dion3-megatron is a minimal one on synthetic data.
"""

_EPILOG = """\
With --optimizer dion3, Dion3 steps the 2-D hidden matrices and Megatron's Adam (--adam-*) the
embeddings, output layer, norms and biases; --lr, --weight-decay, --clip-grad and the lr schedule
act as for every Megatron optimizer. --use-distributed-optimizer gives the layer-wise ZeRO-1
layout. "SCRIPT --help" lists Megatron-LM's flags with these. Docs: docs/megatron.md.

examples:
  python -m dion3_megatron.megatron.launch pretrain_gpt.py --optimizer dion3 \\
      --use-distributed-optimizer --bf16 --lr 0.01 --dion3-fraction 0.25 ...
  torchrun --nproc-per-node 8 -m dion3_megatron.megatron.launch pretrain_gpt.py ...
"""


def help_parser() -> argparse.ArgumentParser:
    """The launcher's own parser, for ``--help``: its usage, and the ``--dion3-*`` flags with their
    defaults (from :mod:`dion3_megatron.options`, as Megatron-LM's parser gets them)."""
    from .arguments import add_dion3_arguments

    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [-h] SCRIPT [SCRIPT ARGS ...]\n       torchrun [...] -m dion3_megatron.megatron.launch SCRIPT [SCRIPT ARGS ...]",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_Formatter,
        allow_abbrev=False,
    )
    parser.add_argument("script", metavar="SCRIPT", help="the training script (e.g. Megatron-LM's pretrain_gpt.py)")
    parser.add_argument(
        "args",
        metavar="SCRIPT ARGS",
        nargs=argparse.REMAINDER,
        help="its arguments: Megatron-LM's flags, --optimizer dion3 and the flags below",
    )
    return add_dion3_arguments(parser)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=100)


def helpers_prebuilt(_current: Any = None) -> bool:
    """Whether the dataset helpers come compiled (``helpers_cpp`` imports), as in the megatron-core wheel."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def skip_compile_helpers(compile_helpers):
    """Megatron-LM's ``initialize_megatron`` runs ``make`` in megatron/core/datasets for the dataset
    helpers and exits when it fails. The megatron-core wheel ships those helpers compiled
    (``helpers_cpp``) but not their Makefile, so a script run against the wheel (Megatron-LM's
    pretrain_gpt.py from a copy, or examples/megatron_lm_pretrain_gpt.py) would stop there. Under
    the launcher, where the compiled module imports (:func:`helpers_prebuilt`), the compile is
    skipped (the entry of :data:`LAUNCHER`); a source tree without it builds as before."""

    def compile_helpers():
        """Nothing to build: the dataset helpers come compiled (dion3_megatron.megatron.launch)."""

    return compile_helpers


# What the launcher changes besides dion3_megatron.megatron.registry.MEGATRON (register(launcher=True)
# applies both); the fields: dion3_megatron.compat.
LAUNCHER: tuple[compat.Patch, ...] = (
    compat.Patch(
        "megatron.core.datasets.utils:compile_helpers",
        skip_compile_helpers,
        "Megatron-LM's initialize_megatron runs make for the dataset helpers, which the wheel ships compiled "
        "but without their Makefile: a script run against the wheel would stop there",
        MCORE_019,
        when="where the dataset helpers come compiled (the megatron-core wheel)",
        only_if=helpers_prebuilt,
    ),
)


def single_process_world(environ: MutableMapping[str, str]) -> None:
    """Megatron-LM initializes torch.distributed from the environment (env://), which torchrun fills.
    Started with plain ``python``, the script would stop at "MASTER_ADDR expected, but not set":
    give it a world of one process instead. Under torchrun (or any launcher that sets WORLD_SIZE)
    nothing changes."""
    if "WORLD_SIZE" in environ:
        return
    import socket

    with socket.socket() as s:  # a free port on this host, as torchrun --standalone picks one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        environ.setdefault(name, value)


class _FirstRankErrorParser(argparse.ArgumentParser):
    """A parser whose errors are one line without the usage, printed by the first rank alone."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def check_arguments(args: list[str]) -> None:
    """Check a script's Dion3 arguments before it starts: the ``--dion3-*`` values, and with
    ``--optimizer dion3`` ``--lr`` and ``--weight-decay`` (which Dion3 takes), by the option spec,
    and Megatron's precision-aware and offload settings (:func:`.precision.refusal`,
    :func:`.offload.offload_refusal`).
    Megatron-LM would take them only after its imports and process group, on every rank; a bad one
    exits here with one line naming the flag and the value, printed by the first rank alone."""
    from .. import options
    from .arguments import OPTIMIZER_NAME, add_dion3_arguments, fsdp2_tensor_parallel_refusal
    from .offload import offload_refusal
    from .precision import refusal as precision_refusal

    parser = _FirstRankErrorParser(prog=PROG, add_help=False, allow_abbrev=False)
    parser.add_argument("--optimizer")
    parser.add_argument("--use-torch-fsdp2", action="store_true")
    parser.add_argument("--use-megatron-fsdp", action="store_true")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    for flag in ("--optimizer-cpu-offload", "--use-torch-optimizer-for-cpu-offload", "--use-precision-aware-optimizer"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--optimizer-offload-fraction", type=float, default=1.0)
    for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-params-dtype", "--main-grads-dtype"):
        parser.add_argument(flag, default="fp32")
    add_dion3_arguments(parser)
    known = parser.parse_known_args(args)[0]
    if known.optimizer != OPTIMIZER_NAME:  # another optimizer's --lr is Megatron's
        return
    for name in ("lr", "weight_decay"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=options.BY_NAME[name].argparse_type())
    parser.parse_known_args(args)
    if known.use_megatron_fsdp:
        parser.error(
            "--optimizer dion3 does not run under Megatron-FSDP (--use-megatron-fsdp); use --use-torch-fsdp2 "
            "(torch FSDP2) or --use-distributed-optimizer (the layer-wise ZeRO-1 layout)"
        )
    if known.use_torch_fsdp2 and known.tensor_model_parallel_size > 1:
        parser.error(fsdp2_tensor_parallel_refusal(known.tensor_model_parallel_size))
    refusal = precision_refusal(known, flags=True) or offload_refusal(known, flags=True)
    if refusal is not None:
        parser.error(refusal)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        parser = help_parser()
        if argv:
            parser.print_help()
            raise SystemExit(0)
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: the training script is missing (--help for more)", file=sys.stderr)
        raise SystemExit(2)
    script, args = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"{PROG}: no such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    check_arguments(args)
    from . import register

    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python SCRIPT (a tree beside it wins)
    register(launcher=True)
    single_process_world(os.environ)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
