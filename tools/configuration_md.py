"""Write docs/configuration.md, the option reference, from the option spec (dion3_megatron/options.py).

    python tools/configuration_md.py [PATH]

tests/test_configuration_doc.py fails while the page differs from what this writes.
"""

from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's spec, not an installed copy

from dion3_megatron import options  # noqa: E402

DEFAULT_PATH = REPO / "docs" / "configuration.md"


def main(argv: list[str]) -> None:
    path = pathlib.Path(argv[0]) if argv else DEFAULT_PATH
    path.write_text(options.markdown_reference(), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
