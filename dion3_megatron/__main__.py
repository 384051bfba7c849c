"""``python -m dion3_megatron``: a report of this environment for Dion3 (see :mod:`.report`)."""

from __future__ import annotations

import argparse
import sys

from . import report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dion3_megatron",
        description="Report the versions, the front ends that import, the GPU and its kernels, and what "
        'fraction="auto" chooses for given matrix shapes on this machine.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="ROWSxCOLS",
        help="a matrix shape to show the automatic f of, e.g. 4096x14336 (repeat for several)",
    )
    parser.add_argument("--world", type=int, default=1, help="ranks the matrices' step is spread over, for --shape")
    parser.add_argument("--batch", type=int, default=1, help="same-shape matrices stepped together (one per layer), for --shape")
    args = parser.parse_args(argv)
    try:
        args.shape = [report.parse_shape(s) for s in args.shape]
    except ValueError as error:
        parser.error(f"--shape: {error}")
    for name in ("world", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for title, lines in report.sections(args.shape, args.world, args.batch):
        print(report.render(title, lines()), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
