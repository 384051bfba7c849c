"""Megatron-LM command-line flags for Dion3 (``--optimizer dion3`` and the ``--dion3-*`` group).

Every flag is derived from :mod:`dion3_megatron.options` (the options whose front ends include
"megatron"): option ``name`` is the flag ``--dion3-<name>`` (a bool that defaults to True is
``--dion3-no-<name>``) and the ``OptimizerConfig`` / args attribute ``dion3_<name>``. Registration
(:func:`dion3_megatron.megatron.register`) adds them to Megatron-LM's parser. Values are checked by
argparse itself, so a bad value stops the launch with argparse's usual ``error: argument ...``.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from .. import options

OPTIMIZER_NAME = "dion3"
OPTIONS = options.options_for(options.MEGATRON)


def config_field(name: str) -> str:
    """The ``OptimizerConfig`` / args attribute of an option."""
    return f"dion3_{name}"


def flag(name: str) -> str:
    """The command-line flag of an option (of a bool that defaults to True: its --dion3-no- form)."""
    option = options.BY_NAME.get(name)
    negated = option is not None and option.kind == options.BOOL and option.default is True
    return f"--dion3-{'no-' if negated else ''}{name.replace('_', '-')}"


# config field -> default, for every Dion3 option Megatron carries.
DION3_DEFAULTS = {config_field(option.name): option.default for option in OPTIONS}


def check_dion3_values(values: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the option and its value when a ``dion3_*`` value (from an
    ``OptimizerConfig`` attribute or Megatron-LM's args) has the wrong type or range: a bool
    option given as the string "false" must not turn into True."""
    options.check(where, prefix="dion3_", **{option.name: values[config_field(option.name)] for option in OPTIONS})


# Above this, Megatron's Adam on the embeddings and output layer is past what suits it (AdamW's best
# lr in the convergence protocol was 0.0015-0.003; at 0.02 the loss spikes).
ADAM_LR_LIMIT = 0.005


def warn_if_adam_takes_the_dion3_lr(args: Any) -> None:
    """Warn (once per process) when ``--optimizer dion3`` runs Megatron's Adam part (embeddings,
    output layer, norms) at a Dion3-sized ``--lr`` because ``--decoupled-lr`` is not given."""
    lr = getattr(args, "lr", None)
    if getattr(args, "decoupled_lr", None) is None and lr is not None and lr > ADAM_LR_LIMIT:
        warnings.warn(f"--optimizer dion3 --lr {lr} without --decoupled-lr: Megatron's Adam steps the embeddings "
                      f"and the output layer at lr {lr} too, more than suits Adam there (above {ADAM_LR_LIMIT}); "
                      "pass --decoupled-lr, e.g. 0.002 (docs/tuning.md, What takes AdamW)", stacklevel=2)


def _default_text(option: options.Option) -> str:
    if option.kind == options.BOOL:
        return "on by default" if option.default else "default: off"
    if option.default is None:
        return "default: unset"
    return f"default: {option.default}"


def _add(group, option: options.Option) -> None:
    # argparse %-formats help strings: a literal % must be written %%.
    text = option.help.replace("%", "%%")
    help = f"{text[0].upper()}{text[1:]} ({_default_text(option)})."
    dest = config_field(option.name)
    if option.kind == options.BOOL:
        action = "store_false" if option.default else "store_true"
        if option.default:
            help = f"Turn off (on by default): {text}."
        group.add_argument(flag(option.name), action=action, dest=dest, default=option.default, help=help)
    elif option.kind == options.CHOICE:
        group.add_argument(flag(option.name), dest=dest, choices=option.choices, default=option.default, help=help)
    elif option.kind in (options.REAL, options.FRACTION):
        group.add_argument(flag(option.name), dest=dest, type=option.argparse_type(), default=option.default,
                           metavar=option.name.upper(), help=help)
    else:
        raise AssertionError(f"no Megatron flag for an option of kind {option.kind!r} ({option.name})")


def escape_unformattable_help(parser: argparse.ArgumentParser) -> None:
    """Make ``parser.format_help()`` work. argparse %-formats every help string, and megatron-core
    0.19.2 has one with a bare ``%`` (``--moe-paged-stash-buffer-size-factor-cuda``, from a
    TransformerConfig docstring: "... (e.g. 1.10 = 10%)."), so ``pretrain_gpt.py --help`` dies
    with ``unsupported format character ')'``. A help string that does not format gets ``%%`` for
    each ``%`` (shown as written); the others keep theirs (``%(default)s`` still expands)."""
    formatter = parser._get_formatter()  # noqa: SLF001 - argparse's own expansion of a help string
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action.help, str) and "%" in action.help:
            try:
                formatter._expand_help(action)  # noqa: SLF001
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")


def add_dion3_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``dion3`` to ``--optimizer``'s choices (when the parser has that flag) and the Dion3 group,
    and make the parser's ``--help`` survive help strings it cannot format
    (:func:`escape_unformattable_help`).

    Idempotent: a parser that already has ``--dion3-fraction`` gets no second group.
    """
    escape_unformattable_help(parser)
    for action in parser._actions:  # noqa: SLF001 - argparse has no public way to edit choices
        if "--optimizer" in action.option_strings and action.choices is not None:
            if OPTIMIZER_NAME not in action.choices:
                action.choices = list(action.choices) + [OPTIMIZER_NAME]
        if "--dion3-fraction" in action.option_strings:
            return parser
    group = parser.add_argument_group(title="Dion3 optimizer (--optimizer dion3)")
    for option in OPTIONS:
        _add(group, option)
    return parser
