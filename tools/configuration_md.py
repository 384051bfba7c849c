"""Write docs/configuration.md, the option reference, from the option spec (dion3_megatron/options.py).

    python tools/configuration_md.py [PATH]

tests/unit/test_configuration_doc.py fails while the page differs from what this writes, and checks
that every spelling the page gives is what the front ends (and Megatron's and Trainer's own
flags) take.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import pathlib
import sys
import textwrap
from typing import Any
from unittest import mock

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's spec, not an installed copy

from dion3_megatron import options  # noqa: E402
from dion3_megatron.kernels import config as kernel_config  # noqa: E402
from dion3_megatron.options import BOOL, DEEPSPEED, DTYPE, MEGATRON, REAL, STORAGE_DTYPE, TORCH, Option  # noqa: E402

DEFAULT_PATH = REPO / "docs" / "configuration.md"
REFERENCE_COMMAND = "python tools/configuration_md.py"
MEGATRON_LM, TRAINER = "Megatron's", "Trainer's"  # whose default a flag's is


@dataclasses.dataclass(frozen=True)
class OwnFlag:
    """A flag of Megatron-LM or of Trainer that sets what a Dion3 option sets elsewhere."""

    flag: str
    default: Any  # the framework's own default (None: unset)


@dataclasses.dataclass(frozen=True)
class MegatronOwn:
    """How Megatron sets an option it takes through its own flags."""

    flags: tuple[OwnFlag, ...]
    text: str  # what they step; "{flags}" is replaced by the flags with their defaults


# Options Megatron takes through its own flags (Megatron-LM 0.19's defaults), not a --dion3-* one.
MEGATRON_OWN = {
    "lr": MegatronOwn(
        (OwnFlag("--lr", None),), "{flags}: the matrices' lr (unset: Dion3's 0.01), and the lr of Megatron's Adam for the other tensors"
    ),
    "adamw_lr": MegatronOwn(
        (OwnFlag("--decoupled-lr", None), OwnFlag("--lr", None)),
        "Megatron's Adam: {flags}; the embeddings and the output layer take the first (unset: the second), norms and biases the second",
    ),
    "weight_decay": MegatronOwn((OwnFlag("--weight-decay", 0.01),), "{flags}: the matrices' and Megatron's Adam's"),
    "betas": MegatronOwn((OwnFlag("--adam-beta1", 0.9), OwnFlag("--adam-beta2", 0.999)), "Megatron's Adam: {flags}"),
    "offload": MegatronOwn(
        (OwnFlag("--optimizer-cpu-offload", False), OwnFlag("--optimizer-offload-fraction", 1.0)),
        "{flags}: Dion3's state (a fraction of 0 offloads none; between 0 and 1 is refused); Megatron's Adam part stays on the GPU",
    ),
}

# Options whose --dion3-* flag sets only part of what the option sets elsewhere: what Megatron's own flag steps.
MEGATRON_ALSO = {
    "eps": MegatronOwn((OwnFlag("--adam-eps", 1e-08),), "NorMuon's epsilon; Megatron's Adam takes {flags}"),
    "momentum_dtype": MegatronOwn(
        (OwnFlag("--use-precision-aware-optimizer", False), OwnFlag("--exp-avg-dtype", "fp32")),
        "Megatron's precision-aware optimizer sets it too: {flags}, fp32 or bf16 (given both ways, the two must agree); "
        "Megatron's Adam keeps fp32 moments",
    ),
}

# DeepSpeed keys that Hugging Face Trainer also sets, with its flag (a TrainingArguments field) and default.
TRAINER_OWN = {
    "lr": (OwnFlag("--learning_rate", 5e-05),),
    "weight_decay": (OwnFlag("--weight_decay", 0.0),),
    "betas": (OwnFlag("--adam_beta1", 0.9), OwnFlag("--adam_beta2", 0.999)),
    "eps": (OwnFlag("--adam_epsilon", 1e-08),),
}

# What a kernel configuration field's value set by an environment variable does.
KERNEL_EFFECTS = {
    ("kernels", "torch"): "plain torch for every matrix product of the step, and no Triton row kernels",
    ("fused_rows", False): "no Triton row kernels (the symmetric-GEMM kernels still run where they pay)",
}


def cell(text: str) -> str:
    """Text for a Markdown table cell: no pipes, no emphasis from ``**``."""
    return text.replace("|", "\\|").replace("*", "\\*")


def json_value(value: Any) -> Any:
    """A default as a JSON config writes it."""
    return list(value) if isinstance(value, tuple) else value


def flag_value(value: Any) -> str:
    """A default as a command line writes it (None: the flag left out)."""
    return "unset" if value is None else str(value)


def values(option: Option) -> str:
    """What an option takes; an unset number (None, the default) too."""
    unset = "None or " if option.default is None and option.kind == REAL else ""
    return unset + option.allowed()


def megatron_flag(option: Option) -> str:
    """arguments.flag(): a bool that defaults to True is switched off by --dion3-no-<name>."""
    negated = option.kind == BOOL and option.default is True
    return f"--dion3-{'no-' if negated else ''}{option.name.replace('_', '-')}"


def own_flags(flags: tuple[OwnFlag, ...], whose: str) -> str:
    return ", ".join(f"`{f.flag}` ({whose} default: {flag_value(f.default)})" for f in flags)


def torch_cell(option: Option) -> str:
    if TORCH not in option.front_ends:
        return "—"
    where = "param-group key" if option.group_key else "one per optimizer"
    dtype = {DTYPE: " (a `torch.dtype` or its name)", STORAGE_DTYPE: " (or its `torch.dtype`)"}.get(option.kind, "")
    return f"`{option.name}={option.default!r}`{dtype}, {where}"


def megatron_cell(option: Option) -> str:
    if MEGATRON not in option.front_ends:
        own = MEGATRON_OWN.get(option.name)
        return own.text.format(flags=own_flags(own.flags, MEGATRON_LM)) if own else "—"
    flag = megatron_flag(option)
    if option.kind == BOOL:
        text = f"`{flag}` (sets {not option.default}; default {option.default})"
    else:
        text = f"`{flag}` (default: {flag_value(option.default)})"
    text += f", `dion3_{option.name}`"
    also = MEGATRON_ALSO.get(option.name)
    if also:
        text += ": " + also.text.format(flags=own_flags(also.flags, MEGATRON_LM))
    return text


def deepspeed_cell(option: Option) -> str:
    if DEEPSPEED not in option.front_ends:
        return "—"
    text = f"`{json.dumps(option.name)}: {json.dumps(json_value(option.default))}`"
    if option.kind == DTYPE:
        text += f" or a name, e.g. `{json.dumps(next(iter(options.NS_DTYPES)))}`"
    return text


def kernel_environment() -> list[tuple[str, str, str]]:
    """(variable, value, effect) for each environment variable kernels.config.from_environment
    reads: the variables found in its source, the effect by calling it with each set to "0"."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel_config.from_environment)))
    names = [
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.environ.get" and isinstance(node.args[0], ast.Constant)
    ]

    def read(**set_to: str) -> dict[str, Any]:
        with mock.patch.dict(os.environ):  # restored on exit
            for name in names:
                os.environ.pop(name, None)
            os.environ.update(set_to)
            config = kernel_config.from_environment()
            return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.compare}

    default = read()
    rows = []
    for name in names:
        effects = []
        for field, value in read(**{name: "0"}).items():
            if value != default[field]:
                if (field, value) not in KERNEL_EFFECTS:
                    raise KeyError(f"{name}=0 sets {field}={value!r}: describe it in KERNEL_EFFECTS")
                effects.append(f"`{field}={value!r}` (else {default[field]!r}): {KERNEL_EFFECTS[field, value]}")
        rows.append((name, "0", "; ".join(effects)))
    return rows


def markdown_reference() -> str:
    """docs/configuration.md: every option (the values it takes, its spelling and default in each
    front end, what it does), the keys Trainer also sets, and the kernels' environment variables."""
    lines = [
        f"<!-- Generated from dion3_megatron/options.py by `{REFERENCE_COMMAND}`: edit the spec, not this page. -->",
        "",
        "# Configuration",
        "",
        "Every Dion3 option: the values it takes, how each front end spells it, with its default there,",
        "and what it does. Each front end takes its options, defaults and checks from one spec",
        "(`dion3_megatron/options.py`).",
        "",
        "- **PyTorch**: keyword arguments, `Dion3(params, fraction=0.25)`. A param-group key may also be",
        '  set per param group (`{"params": [...], "fraction": 0.5}`); the others hold for the whole optimizer.',
        "- **Megatron** (`--optimizer dion3`): the flag `--dion3-<name>` (for a bool that is on by default,",
        "  `--dion3-no-<name>`), or the attribute `dion3_<name>` of Megatron's `OptimizerConfig`;",
        "  `MegatronDion3` takes the same names as keyword arguments. The learning rates, the weight decay",
        "  and Adam's betas are Megatron's own flags, with Megatron's defaults: Megatron's Adam steps the",
        "  embeddings, the output layer, norms and biases.",
        '- **DeepSpeed**: keys of `"optimizer": {"type": "Dion3", "params": {...}}`, in JSON: `null` for',
        "  None, a list for a tuple, a dtype by its name.",
        "- **Hugging Face Trainer** (with `--deepspeed ds_config.json`): the DeepSpeed config, with the same",
        "  keys; Trainer also sets four of them ([below](#hugging-face-trainer)).",
        "",
        'None (JSON `null`, a flag left out: "unset") is a default of its own, which the column "meaning"',
        'describes. A value outside the column "values" stops with an error that names the option, the',
        "value and what the option takes.",
        "",
        "## Options",
        "",
        '| option | values | PyTorch (default) | Megatron flag (default), config field | DeepSpeed `"params"` (default) | meaning |',
        "|---|---|---|---|---|---|",
    ]
    for o in options.OPTIONS:
        meaning = f"{o.help[0].upper()}{o.help[1:]}."
        lines.append(f"| `{o.name}` | {cell(values(o))} | {torch_cell(o)} | {megatron_cell(o)} | {deepspeed_cell(o)} | {cell(meaning)} |")
    lines += [
        "",
        "## Hugging Face Trainer",
        "",
        'Trainer hands DeepSpeed the same `"optimizer"` block. It also sets these keys from its own flags',
        '(`TrainingArguments` fields): a key set to `"auto"` takes Trainer\'s value; a number must equal',
        "Trainer's (else Trainer refuses the config); a key left out keeps Dion3's default. Every other key",
        "is Dion3's alone, as under DeepSpeed.",
        "",
        "| key | `\"auto\"`: Trainer's flag (default) | left out: Dion3's default |",
        "|---|---|---|",
    ]
    for name, flags in TRAINER_OWN.items():
        default = json.dumps(json_value(options.BY_NAME[name].default))
        lines.append(f'| `"{name}"` | {own_flags(flags, TRAINER)} | `{default}` |')
    lines += [
        "",
        "## Kernel environment variables",
        "",
        "Defaults for the process's kernel configuration, read at each step of an optimizer whose `kernels`",
        "option is None, unless `dion3_megatron.kernels.configure()` set a configuration; an optimizer's",
        "`kernels` option other than None overrides them for its steps.",
        "",
        "| variable | value | effect (unset or any other value: the default) |",
        "|---|---|---|",
    ]
    for name, value, effect in kernel_environment():
        lines.append(f"| `{name}` | `{value}` | {cell(effect)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    path = pathlib.Path(argv[0]) if argv else DEFAULT_PATH
    path.write_text(markdown_reference(), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
