"""The examples' command lines: every option's default in ``--help``, and a hint where an option
is spelled as another front end spells it (``--fraction`` here, ``--dion3-fraction`` in Megatron's)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


class ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ExampleParser(argparse.ArgumentParser):
    """``other_spellings``: {an option this script does not take: the one it takes for the same thing}."""

    def __init__(self, *args, other_spellings: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, formatter_class=ShowDefaults, **kwargs)
        self.other_spellings = dict(other_spellings or {})

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        for word in sys.argv[1:] if args is None else args:
            if word == "--":
                break
            flag = word.split("=", 1)[0]
            if flag in self.other_spellings:
                self.error(f"unrecognized arguments: {flag} (did you mean {self.other_spellings[flag]}?)")
        return super().parse_known_args(args, namespace)
