"""docs/configuration.md is what tools/configuration_md.py renders from the option spec, and every
spelling it gives is what the front end takes: keyword arguments and their defaults, flags, config
fields, JSON values, Megatron's and Trainer's own flags with their defaults, and the kernels'
environment variables."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib.util
import inspect
import json
import re

import pytest
import torch
from support.repository import ROOT, load_tool

from dion3_megatron import Dion3, options
from dion3_megatron.kernels import config as kernel_config

PAGE = ROOT / "docs" / "configuration.md"
TOOL_PATH = ROOT / "tools" / "configuration_md.py"


tool = load_tool("configuration_md")
REFERENCE = tool.markdown_reference()
TORCH_COLUMN, MEGATRON_COLUMN = "PyTorch (default)", "Megatron flag (default), config field"
DEEPSPEED_COLUMN = 'DeepSpeed `"params"` (default)'


def test_configuration_md_is_current():
    actual = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    if actual != REFERENCE:
        diff = "".join(
            list(difflib.unified_diff(actual.splitlines(True), REFERENCE.splitlines(True), "docs/configuration.md", "generated"))[:60]
        )
        pytest.fail(
            f"docs/configuration.md is not what the option spec renders; regenerate it with\n\n    {tool.REFERENCE_COMMAND}\n\n{diff}"
        )


def test_the_page_says_it_is_generated_and_how():
    first = REFERENCE.splitlines()[0]
    assert "Generated" in first and tool.REFERENCE_COMMAND in first
    assert tool.REFERENCE_COMMAND == f"python {TOOL_PATH.relative_to(ROOT).as_posix()}"


def test_the_command_writes_the_page(tmp_path):
    assert tool.DEFAULT_PATH == PAGE
    tool.main([str(tmp_path / "page.md")])
    assert (tmp_path / "page.md").read_text(encoding="utf-8") == REFERENCE


def test_the_shipped_package_has_no_generator():
    assert not hasattr(options, "markdown_reference")
    assert "unittest" not in (ROOT / "dion3_megatron" / "options.py").read_text(encoding="utf-8")


def table(heading: str) -> list[dict[str, str]]:
    """The first table after ``heading``: one {column: cell} per row."""
    lines = REFERENCE.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and i > lines.index(heading))
    header = [c.strip() for c in lines[start].strip("|").split(" | ")]
    found = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == len(header), line
        found.append(dict(zip(header, cells)))
    return found


def rows() -> dict[str, dict[str, str]]:
    """The options table: option name -> {column: cell}."""
    return {row["option"].strip("`"): row for row in table("## Options")}


def own_flags(cell: str, whose: str) -> dict[str, str]:
    """{flag: the default written for it} of the framework flags a cell names."""
    return dict(re.findall(rf"`(--[a-z0-9_-]+)` \({re.escape(whose)} default: ([^)]+)\)", cell))


def written(value) -> str:
    """A framework flag's default as the page writes it."""
    return "unset" if value is None else str(value)


def test_one_row_per_option_in_spec_order():
    assert list(rows()) == [o.name for o in options.OPTIONS]


def test_values_are_what_the_spec_takes():
    for name, row in rows().items():
        option = options.BY_NAME[name]
        assert option.allowed() in row["values"].replace("\\", ""), name
        assert ("None" in row["values"]) == (option.default is None), name


def test_pytorch_column_is_what_dion3_takes_with_its_defaults():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    group = Dion3([p]).param_groups[0]
    signature = inspect.signature(Dion3).parameters
    for name, row in rows().items():
        cell = row[TORCH_COLUMN]
        if name not in signature:
            assert cell == "—", name
            continue
        keyword, value = re.match(r"`(\w+)=([^`]+)`", cell).groups()
        assert keyword == name and ast.literal_eval(value) == signature[name].default, name
        assert ("param-group key" in cell) == (name in group), name
        assert ("one per optimizer" in cell) == (name not in group), name
        if "its name" in cell:  # a dtype by name
            Dion3([torch.nn.Parameter(torch.zeros(4, 4))], **{name: next(iter(options.NS_DTYPES))})


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_column_is_json_the_config_accepts():
    from support.deepspeed_helpers import import_keeping_environment

    dion3_ds = import_keeping_environment("dion3_megatron.deepspeed")
    for name, row in rows().items():
        cell = row[DEEPSPEED_COLUMN]
        if name not in dion3_ds.CONFIG_KEYS:
            assert cell == "—", name
            continue
        spellings = re.findall(r"`([^`]+)`", cell)
        assert spellings[0].startswith(f'"{name}": '), name
        value = json.loads("{" + spellings[0] + "}")[name]
        assert dion3_ds.normalize_params({name: value})[name] == options.BY_NAME[name].default, name
        for other in spellings[1:]:  # another value the cell names (a dtype by its name)
            dion3_ds.normalize_params({name: json.loads(other)})


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_megatron_column_is_the_flags_fields_and_defaults_megatron_takes():
    from megatron.training.arguments import add_megatron_arguments

    from dion3_megatron.megatron import arguments

    dion3 = arguments.add_dion3_arguments(argparse.ArgumentParser())
    dion3_flags = {s: a for a in dion3._actions for s in a.option_strings}
    megatron = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    megatron_defaults = {s: a.default for a in megatron._actions for s in a.option_strings}
    for name, row in rows().items():
        cell = row[MEGATRON_COLUMN]
        option = options.BY_NAME[name]
        own = own_flags(cell, "Megatron's")
        for flag, default in own.items():  # Megatron's own flags, with Megatron's defaults
            assert flag in megatron_defaults and written(megatron_defaults[flag]) == default, (name, flag)
        flags = [f for f in re.findall(r"`(--[a-z0-9-]+)`", cell) if f not in own]
        if options.MEGATRON in option.front_ends:
            (flag,) = flags
            assert flag == arguments.flag(name), name
            assert dion3_flags[flag].dest == f"dion3_{name}" and f"`dion3_{name}`" in cell, name
            assert arguments.DION3_DEFAULTS[f"dion3_{name}"] == option.default, name
            if option.kind == options.BOOL:  # the flag sets what the cell says
                value = getattr(dion3.parse_args([flag]), f"dion3_{name}")
                assert f"(sets {value}; default {option.default})" in cell and value is not option.default, name
            else:
                assert f"`{flag}` (default: {written(option.default)})" in cell, name
        else:
            assert "dion3" not in cell and not flags, name
            assert (cell == "—") == (not own), name


def test_megatron_rows_of_megatrons_own_flags_name_them_where_megatron_steps_them():
    """lr, weight decay and betas are Megatron's flags under Megatron; eps is Dion3's for NorMuon and
    --adam-eps for Megatron's Adam."""
    cells = {name: row[MEGATRON_COLUMN] for name, row in rows().items()}
    assert list(own_flags(cells["betas"], "Megatron's")) == ["--adam-beta1", "--adam-beta2"]
    assert list(own_flags(cells["lr"], "Megatron's")) == ["--lr"]
    assert list(own_flags(cells["weight_decay"], "Megatron's")) == ["--weight-decay"]
    assert "`--dion3-eps`" in cells["eps"] and list(own_flags(cells["eps"], "Megatron's")) == ["--adam-eps"]
    assert not any(re.search(r"\(\d", cell) for cell in cells.values())  # no Python tuple for a flag's default


def test_trainer_table_is_what_trainer_fills_with_its_defaults():
    """The keys Trainer's DeepSpeed integration fills from TrainingArguments, each with its flag and
    Trainer's default; a key left out keeps Dion3's default."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments
    from transformers.integrations import deepspeed as hf_deepspeed

    fields = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    source = inspect.getsource(hf_deepspeed.HfTrainerDeepSpeedConfig)
    filled = set(re.findall(r'"optimizer\.params\.(\w+)"', source))
    found = table("## Hugging Face Trainer")
    assert {row["key"].strip('`"') for row in found} == filled
    for row in found:
        name = row["key"].strip('`"')
        assert name in options.defaults_for(options.DEEPSPEED)
        flags = own_flags(row['`"auto"`: Trainer\'s flag (default)'], "Trainer's")
        assert flags and all(f"args.{flag[2:]}" in source for flag in flags), name
        assert all(written(fields[flag[2:]]) == default for flag, default in flags.items()), name
        default = json.loads(row["left out: Dion3's default"].strip("`"))
        assert default == tool.json_value(options.BY_NAME[name].default), name


def test_environment_section_names_what_from_environment_reads(monkeypatch):
    source = inspect.getsource(kernel_config.from_environment)
    read = re.findall(r'os\.environ\.get\("(\w+)"', source)
    assert read == ["DION3_KERNELS", "DION3_FUSED_ROWS"]
    section = REFERENCE[REFERENCE.index("## Kernel environment variables") :]
    found = {line.split(" | ")[0].strip("| `"): line for line in section.splitlines() if line.startswith("| `")}
    assert list(found) == read
    for name in read:
        monkeypatch.delenv(name, raising=False)

    def settings() -> dict:
        config = kernel_config.from_environment()
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.compare}

    default = settings()
    for name in read:
        monkeypatch.setenv(name, "0")
        changed = {k: v for k, v in settings().items() if v != default[k]}
        monkeypatch.delenv(name)
        assert changed, name
        for field, value in changed.items():
            assert f"`{field}={value!r}` (else {default[field]!r})" in found[name], name
