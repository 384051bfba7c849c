"""docs/configuration.md is what the option spec renders (options.markdown_reference), and every
spelling it gives is what the front end takes: defaults, flags, config fields, JSON values, and
the kernels' environment variables."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib.util
import inspect
import json
import pathlib
import re
import runpy

import pytest
import torch

from dion3_megatron import Dion3, options
from dion3_megatron.kernels import config as kernel_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


def test_configuration_md_is_current():
    expected = options.markdown_reference()
    actual = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    if actual != expected:
        diff = "".join(list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                                 "docs/configuration.md", "generated"))[:60])
        pytest.fail(f"docs/configuration.md is not what the option spec renders; regenerate it with\n\n"
                    f"    {options.REFERENCE_COMMAND}\n\n{diff}")


def test_the_page_says_it_is_generated_and_how():
    first = options.markdown_reference().splitlines()[0]
    assert "Generated" in first and options.REFERENCE_COMMAND in first
    assert options.REFERENCE_COMMAND == "python tools/configuration_md.py"


def test_the_command_writes_the_page(tmp_path):
    tool = runpy.run_path(str(ROOT / "tools" / "configuration_md.py"), run_name="configuration_md")
    assert tool["DEFAULT_PATH"] == PAGE
    tool["main"]([str(tmp_path / "page.md")])
    assert (tmp_path / "page.md").read_text(encoding="utf-8") == options.markdown_reference()


def rows() -> dict[str, dict[str, str]]:
    """The options table: option name -> {column: cell}."""
    lines = options.markdown_reference().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| option |"))
    header = [c.strip() for c in lines[start].strip("|").split(" | ")]
    table = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == len(header), line
        row = dict(zip(header, cells))
        table[row["option"].strip("`")] = row
    return table


def test_one_row_per_option_in_spec_order():
    assert list(rows()) == [o.name for o in options.OPTIONS]


def test_defaults_and_values_are_the_spec_and_the_torch_optimizers():
    signature = {name: p.default for name, p in inspect.signature(Dion3).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY}
    for name, row in rows().items():
        option = options.BY_NAME[name]
        default = ast.literal_eval(row["default"].strip("`"))
        assert default == option.default, name
        if name in signature:
            assert default == signature[name], name
        assert option.allowed() in row["values"].replace("\\", ""), name
        assert ("None or" in row["values"]) == (option.default is None), name


def test_pytorch_column_is_what_dion3_takes():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    group = Dion3([p]).param_groups[0]
    signature = inspect.signature(Dion3).parameters
    for name, row in rows().items():
        cell = row["PyTorch"]
        if name not in signature:
            assert cell == "—", name
            continue
        assert cell.startswith(f"`{name}=`"), name
        assert ("param-group key" in cell) == (name in group), name
        assert ("one per optimizer" in cell) == (name not in group), name


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_column_is_json_the_config_accepts():
    from support.deepspeed_helpers import import_keeping_environment

    dion3_ds = import_keeping_environment("dion3_megatron.deepspeed")
    for name, row in rows().items():
        cell = row['DeepSpeed `"params"`']
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
def test_megatron_column_is_the_flags_and_fields_megatron_takes():
    from megatron.training.arguments import add_megatron_arguments

    from dion3_megatron.megatron import arguments

    dion3 = arguments.add_dion3_arguments(argparse.ArgumentParser())
    dion3_flags = {s: a for a in dion3._actions for s in a.option_strings}
    megatron = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    megatron_flags = {s for a in megatron._actions for s in a.option_strings}
    for name, row in rows().items():
        cell = row["Megatron flag, config field"]
        option = options.BY_NAME[name]
        flags = re.findall(r"`(--[a-z0-9-]+)`", cell)
        if options.MEGATRON in option.front_ends:
            (flag,) = flags
            assert flag == arguments.flag(name), name
            assert dion3_flags[flag].dest == f"dion3_{name}" and f"`dion3_{name}`" in cell, name
            assert arguments.DION3_DEFAULTS[f"dion3_{name}"] == option.default, name
            if option.kind == options.BOOL:  # the flag sets what the cell says
                value = getattr(dion3.parse_args([flag]), f"dion3_{name}")
                assert f"(sets {value})" in cell and value is not option.default, name
        else:
            assert "dion3" not in cell, name
            assert (cell == "—") == (not flags), name
            assert set(flags) <= megatron_flags, name


def test_environment_section_names_what_from_environment_reads(monkeypatch):
    source = inspect.getsource(kernel_config.from_environment)
    read = re.findall(r'os\.environ\.get\("(\w+)"', source)
    assert read == ["DION3_KERNELS", "DION3_FUSED_ROWS"]
    page = options.markdown_reference()
    section = page[page.index("## Kernel environment variables"):]
    table = {line.split(" | ")[0].strip("| `"): line for line in section.splitlines() if line.startswith("| `")}
    assert list(table) == read
    for name in read:
        monkeypatch.delenv(name, raising=False)
    default = dataclasses.asdict(kernel_config.from_environment())
    for name in read:
        monkeypatch.setenv(name, "0")
        changed = {k: v for k, v in dataclasses.asdict(kernel_config.from_environment()).items() if v != default[k]}
        monkeypatch.delenv(name)
        assert changed, name
        for field, value in changed.items():
            assert f"`{field}={value!r}` (else {default[field]!r})" in table[name], name
