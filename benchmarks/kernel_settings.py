"""The ``--kernel-config KEY=VALUE`` option of the GPU benchmarks: a kernels.KernelConfig field set
for what the benchmark times (e.g. ``tile=128x256``, ``persistent=True``, ``tile_group=8``)."""

from __future__ import annotations

import argparse
import ast


def kernel_setting(text: str) -> tuple[str, object]:
    """'KEY=VALUE' for kernels.configure, VALUE read as a Python literal where it is one (True,
    132), else as a string (128x256)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--kernel-config takes KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def add_kernel_config_option(parser: argparse.ArgumentParser, what: str) -> None:
    """--kernel-config, repeatable, collected as a list of (key, value) in args.kernel_config."""
    parser.add_argument(
        "--kernel-config",
        type=kernel_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a kernels.KernelConfig field for {what} (repeatable), e.g. tile_group=8",
    )
