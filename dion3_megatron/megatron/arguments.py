"""Megatron-LM command-line flags for Dion3 (``--optimizer dion3`` and the ``--dion3-*`` group).

Every flag is derived from :mod:`dion3_megatron.options` (the options whose front ends include
"megatron"): option ``name`` is the flag ``--dion3-<name>`` (a bool that defaults to True is
``--dion3-no-<name>``) and the ``OptimizerConfig`` / args attribute ``dion3_<name>``. Registration
(:func:`dion3_megatron.megatron.register`) adds them to Megatron-LM's parser. Values are checked by
argparse itself. A mistake in a Dion3 flag (a bad value, an unknown ``--dion3-*`` flag, a misspelt
``--optimizer dion3``) stops the launch with one line naming it, with a hint where there is one,
instead of argparse's usage (all of Megatron-LM's flags) first; an unknown ``dion3_*`` attribute of
an ``OptimizerConfig`` or of the args is refused alike (:func:`refuse_unknown_fields`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Callable, NoReturn

from .. import options

OPTIMIZER_NAME = "dion3"
"""The ``OptimizerConfig.optimizer`` / ``--optimizer`` value that selects Dion3 (``"dist_dion3"`` too)."""
OPTIONS = options.options_for(options.MEGATRON)


def is_dion3(optimizer: Any) -> bool:
    """Whether an ``OptimizerConfig.optimizer`` / ``--optimizer`` value selects Dion3."""
    return isinstance(optimizer, str) and optimizer in (OPTIMIZER_NAME, "dist_" + OPTIMIZER_NAME)


def config_field(name: str) -> str:
    """The ``OptimizerConfig`` / args attribute of an option."""
    return f"dion3_{name}"


def flag(name: str) -> str:
    """The command-line flag of an option (of a bool that defaults to True: its --dion3-no- form)."""
    option = options.BY_NAME.get(name)
    negated = option is not None and option.kind == options.BOOL and option.default is True
    return f"--dion3-{'no-' if negated else ''}{name.replace('_', '-')}"


DION3_DEFAULTS = {config_field(option.name): option.default for option in OPTIONS}
"""``OptimizerConfig`` attribute (``dion3_<option>``) -> default, for every Dion3 option Megatron carries."""
_PREFIX, _FLAG_PREFIX = config_field(""), flag("")


def _hint(unknown: str, spell: Callable[[str], str]) -> str:
    """``options.unknown_name_hint`` for an unknown Dion3 name, with the option names it quotes
    written as Megatron spells them (``spell``: as a config field or as a flag)."""
    names = [option.name for option in OPTIONS]
    hint = options.unknown_name_hint(unknown, names) or ""
    return re.sub(r"'(\w+)'", lambda m: spell(m[1]) if m[1] in names else m[0], hint)


def refuse_unknown_fields(source: Any, where: str) -> None:
    """Raise :class:`~dion3_megatron.options.UnknownOptionError` naming a ``dion3_*`` attribute of
    ``source`` (an ``OptimizerConfig`` or Megatron-LM's args) that is no Dion3 option, with the
    did-you-mean hint: a misspelt one would otherwise leave its option at the default, silently."""
    for name in sorted(vars(source) if hasattr(source, "__dict__") else ()):
        if name.startswith(_PREFIX) and name not in DION3_DEFAULTS:
            hint = _hint(name[len(_PREFIX) :], lambda option: repr(config_field(option)))
            raise options.UnknownOptionError(
                f"{where}: unknown attribute {name}; " + (hint or f"the Dion3 fields are {', '.join(DION3_DEFAULTS)}")
            )


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
        warnings.warn(
            f"--optimizer dion3 --lr {lr} without --decoupled-lr: Megatron's Adam steps the embeddings "
            f"and the output layer at lr {lr} too, more than suits Adam there (above {ADAM_LR_LIMIT}); "
            "pass --decoupled-lr, e.g. 0.002 (docs/tuning.md, What takes AdamW)",
            stacklevel=2,
        )


def fsdp2_tensor_parallel_refusal(tensor_parallel_size: int) -> str:
    """The one line that refuses tensor parallelism under torch FSDP2 for Dion3."""
    return (
        f"--optimizer dion3 --use-torch-fsdp2 steps tensor-parallel size 1, got --tensor-model-parallel-size "
        f"{tensor_parallel_size}; for tensor parallelism drop --use-torch-fsdp2 and pass --use-distributed-optimizer"
    )


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
        group.add_argument(
            flag(option.name), dest=dest, type=option.argparse_type(), default=option.default, metavar=option.name.upper(), help=help
        )
    elif option.kind == options.STORAGE_DTYPE:
        # Unset unless given: Megatron's --exp-avg-dtype may set it (dion3_megatron.megatron.precision).
        help = f"{text[0].upper()}{text[1:]} (default: {option.default}, or --exp-avg-dtype under --use-precision-aware-optimizer)."
        group.add_argument(flag(option.name), dest=dest, choices=tuple(options.MOMENTUM_DTYPES), default=None, help=help)
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


def unknown_flag_error(token: str) -> str:
    """The one line for an unknown ``--dion3-*`` flag, e.g. ``--dion3-momentum: unknown flag; Dion3
    calls its momentum --dion3-mu``."""
    given = token.split("=", 1)[0]
    hint = _hint(given[len(_FLAG_PREFIX) :].replace("-", "_"), flag)
    return f"{given}: unknown flag" + (f"; {hint}" if hint else "")


def _optimizer_error(parser: argparse.ArgumentParser, message: str) -> str | None:
    """``--optimizer X: did you mean dion3?`` when argparse refused a value of ``--optimizer`` that is
    closest to ``dion3`` among its choices (``Dion3``, ``dion``), else None."""
    match = re.match(r"argument --optimizer: invalid choice: '([^']*)'", message)
    if match is None:
        return None
    value = match[1]
    choices = next(
        (
            list(a.choices)
            for a in parser._actions  # noqa: SLF001
            if "--optimizer" in a.option_strings and a.choices
        ),
        [],
    )
    close = [c for c in choices if c.lower() == value.lower()] or difflib.get_close_matches(value, choices, n=1)
    return f"--optimizer {value}: did you mean {OPTIMIZER_NAME}?" if close == [OPTIMIZER_NAME] else None


def _fail(parser: argparse.ArgumentParser, line: str) -> NoReturn:
    """Stop with one line (said by the first rank alone: every rank parses the same arguments)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{parser.prog}: error: {line}", file=sys.stderr)
    raise SystemExit(2)


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make the parser's errors about Dion3 flags one line each, without its usage: a bad value of a
    ``--dion3-*`` flag, an unknown ``--dion3-*`` flag (also where the parser ignores unknown
    arguments: such a flag would change nothing, silently) and ``--optimizer`` misspelt close to
    dion3. Its other errors are its own."""
    error, parse_known_args = parser.error, parser.parse_known_args

    def dion3_error(message: str) -> NoReturn:
        if message.startswith(f"argument {_FLAG_PREFIX}"):
            _fail(parser, message)
        line = _optimizer_error(parser, message)
        if line is not None:
            _fail(parser, line)
        error(message)

    def parse_known_args_checking_dion3(
        args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        known, extras = parse_known_args(args, namespace)
        for token in extras:
            if token.startswith(_FLAG_PREFIX):
                _fail(parser, unknown_flag_error(token))
        return known, extras

    # The parser is the caller's (Megatron-LM builds its own), so its methods are replaced on this
    # instance; setattr, because mypy refuses assigning to a method (method-assign).
    setattr(parser, "error", dion3_error)
    setattr(parser, "parse_known_args", parse_known_args_checking_dion3)


def add_dion3_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``dion3`` to ``--optimizer``'s choices (when the parser has that flag) and the Dion3 group,
    make the parser's ``--help`` survive help strings it cannot format
    (``escape_unformattable_help``) and its errors about Dion3 flags one line each
    (``_one_line_errors``).

    Idempotent: a parser that already has ``--dion3-fraction`` gets no second group.
    """
    escape_unformattable_help(parser)
    for action in parser._actions:  # noqa: SLF001 - argparse has no public way to edit choices
        if "--optimizer" in action.option_strings and action.choices is not None:
            if OPTIMIZER_NAME not in action.choices:
                action.choices = list(action.choices) + [OPTIMIZER_NAME]
        if "--dion3-fraction" in action.option_strings:
            return parser
    _one_line_errors(parser)
    group = parser.add_argument_group(title="Dion3 optimizer (--optimizer dion3)")
    for option in OPTIONS:
        _add(group, option)
    return parser
