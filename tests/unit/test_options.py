"""Every front end agrees with the option spec (dion3_megatron.options): each option is present
where its front ends say, with the spec's default and range, and nothing else is."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
import typing

import pytest
import torch

from dion3_megatron import Dion3, options
from dion3_megatron.core import rule


# A value out of range (or of the wrong type) for each kind, to see every front end refuse it.
_BAD = {
    options.REAL: float("nan"),
    options.FRACTION: 1.5,
    options.BOOL: "false",
    options.CHOICE: "nearby",
    options.HEADS: 0,
    options.DTYPE: "fp16",
    options.STORAGE_DTYPE: "fp16",
    options.BETAS: (0.9, 1.0),
}


def _assert_signature_is_the_spec(cls, front_end: str) -> None:
    """A constructor spells out the front end's options, keyword only, in the spec's order, with
    the spec's defaults and types (what an IDE or a type checker shows), and catches nothing else
    but to refuse it (``**unknown: Never``)."""
    parameters = inspect.signature(cls).parameters
    keyword = [p for p in parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    spec = options.options_for(front_end)
    assert [p.name for p in keyword] == [o.name for o in spec]
    hints = typing.get_type_hints(cls.__init__)
    for p, option in zip(keyword, spec):
        assert p.default == option.default, option.name
        assert hints[option.name] == option.annotation, (option.name, hints[option.name], option.annotation)
    catch_all = [p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert [p.name for p in catch_all] == ["unknown"] and hints["unknown"] is typing.Never


def test_spec_is_consistent():
    assert len(options.BY_NAME) == len(options.OPTIONS)
    for option in options.OPTIONS:
        assert option.front_ends and option.front_ends <= set(options.FRONT_ENDS), option.name
        assert option.help and option.help[-1] != ".", option.name  # the front ends add their own punctuation
        if option.default is not None or option.kind in (options.HEADS, options.DTYPE):
            assert option.valid(option.default), option.name
        assert not option.valid(_BAD[option.kind]), option.name
        if option.hyperparameter:
            assert option.group_key, option.name


def test_rule_hyperparameters_take_their_defaults_from_the_spec():
    """The rule's settings declare no defaults of their own: options.hyperparameters() fills in the spec's."""
    fields = dataclasses.fields(rule.Dion3Hyperparameters)
    assert tuple(f.name for f in fields) == options.hyperparameter_names()
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)
    hp = options.hyperparameters()
    defaults = {name: options.BY_NAME[name].default for name in options.hyperparameter_names()}
    assert defaults["fraction"] == hp.fraction == rule.AUTO  # the plan chooses f (engine.plan.chooses_fraction)
    assert defaults["momentum_dtype"] == "fp32" and hp.momentum_dtype is torch.float32  # the name as its torch.dtype
    assert dataclasses.asdict(hp) == {**defaults, "momentum_dtype": torch.float32}
    assert options.hyperparameters(fraction=0.5, mu=0.9) == dataclasses.replace(hp, fraction=0.5, mu=0.9)
    unknown = options.UnknownOptionError
    with pytest.raises(unknown, match="'fractoin' is not a field of Dion3Hyperparameters \\(did you mean 'fraction'\\?\\)"):
        options.hyperparameters(fractoin=0.5)
    with pytest.raises(options.UnknownOptionError, match="'betas' is not a field"):
        options.hyperparameters(betas=(0.9, 0.95))


def test_torch_constructor_takes_exactly_the_torch_options():
    _assert_signature_is_the_spec(Dion3, options.TORCH)
    opt = Dion3([torch.nn.Parameter(torch.zeros(4, 4))])
    group = opt.param_groups[0]
    for name in options.group_keys(options.TORCH):
        assert group[name] == options.BY_NAME[name].default, name
    assert opt.cuda_graph is options.BY_NAME["cuda_graph"].default
    with pytest.raises(options.UnknownOptionError, match="Dion3: 'fractoin' is not a Dion3 option here \\(did you mean 'fraction'\\?\\)"):
        Dion3([torch.nn.Parameter(torch.zeros(4, 4))], fractoin=0.5)


@pytest.mark.parametrize(
    "name, words",
    [
        ("momentum", "Dion3 calls its momentum 'mu'"),
        ("nesterov", "there is no Nesterov option"),
        ("beta1", "Dion3 calls its momentum 'mu'"),
        ("adam_lr", "Dion3 calls it 'adamw_lr'"),
    ],
)
def test_names_of_other_optimizers_get_the_dion3_name_in_every_front_end(name, words):
    """One table of hints (options.HINTS) and one exception type (options.UnknownOptionError, a
    TypeError): the torch class's unknown keyword and param-group key, the DeepSpeed class's and
    config's unknown key, Megatron's class's keyword."""
    hinted = f"{name!r} is not a Dion3 option here \\(.*{re.escape(words)}"
    with pytest.raises(options.UnknownOptionError, match=f"Dion3: {hinted}"):
        Dion3([torch.nn.Parameter(torch.zeros(4, 4))], **{name: 0.9})
    with pytest.raises(options.UnknownOptionError, match=f"param group 0: {hinted}"):
        Dion3([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], name: 0.9}])
    from support.deepspeed_helpers import import_keeping_environment

    dion3_ds = import_keeping_environment("dion3_megatron.deepspeed")
    with pytest.raises(options.UnknownOptionError, match=hinted):
        dion3_ds.normalize_params({name: 0.9})
    with pytest.raises(options.UnknownOptionError, match=f"DeepSpeedDion3 .*: {hinted}"):
        dion3_ds.DeepSpeedDion3([torch.nn.Parameter(torch.zeros(4, 4))], **{name: 0.9})
    if importlib.util.find_spec("megatron") is not None:
        from dion3_megatron.megatron.optimizer import MegatronDion3

        with pytest.raises(options.UnknownOptionError, match=f"MegatronDion3: {hinted}"):
            MegatronDion3([torch.nn.Parameter(torch.zeros(4, 4))], **{name: 0.9})


def test_betas_where_not_an_option_and_typos_get_a_hint():
    assert options.unknown_name_hint("betas", options.defaults_for(options.MEGATRON)).startswith("Dion3 calls its momentum 'mu'")
    assert options.unknown_name_hint("fractoin", options.defaults_for(options.TORCH)) == "did you mean 'fraction'?"
    assert options.unknown_name_hint("zzz", options.defaults_for(options.TORCH)) is None


@pytest.mark.parametrize("option", options.options_for(options.TORCH), ids=lambda o: o.name)
def test_torch_refuses_what_the_spec_refuses(option):
    with pytest.raises(ValueError, match=f"{option.name} must be"):
        Dion3([torch.nn.Parameter(torch.zeros(4, 4))], **{option.name: _BAD[option.kind]})


def test_scale_mu_by_fraction_without_a_mu_is_refused_in_each_front_end():
    """mu unset already depends on f: scaling it again is refused, naming both options."""
    words = "scale_mu_by_fraction=True scales an explicit mu, got mu=None"
    with pytest.raises(ValueError, match=words):
        Dion3([torch.nn.Parameter(torch.zeros(4, 4))], scale_mu_by_fraction=True)
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = Dion3([p], scale_mu_by_fraction=True, mu=0.9)
    opt.param_groups[0]["mu"] = None
    p.grad = torch.ones(4, 4)
    with pytest.raises(ValueError, match="param group 0: " + words):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(4, 4)) and not opt.state[p]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_keys_are_the_deepspeed_options():
    from support.deepspeed_helpers import import_keeping_environment

    dion3_ds = import_keeping_environment("dion3_megatron.deepspeed")
    CONFIG_KEYS, DeepSpeedDion3, normalize_params = dion3_ds.CONFIG_KEYS, dion3_ds.DeepSpeedDion3, dion3_ds.normalize_params

    assert list(CONFIG_KEYS) == [o.name for o in options.options_for(options.DEEPSPEED)]
    _assert_signature_is_the_spec(DeepSpeedDion3, options.DEEPSPEED)
    for option in options.options_for(options.DEEPSPEED):
        with pytest.raises(ValueError, match=f"{option.name} must be"):
            normalize_params({option.name: _BAD[option.kind]})
        with pytest.raises(ValueError, match=f"{option.name} must be"):
            DeepSpeedDion3([torch.nn.Parameter(torch.zeros(4, 4))], **{option.name: _BAD[option.kind]})


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_megatron_flags_config_fields_and_kwargs_are_the_megatron_options():
    import argparse
    from types import SimpleNamespace

    import dion3_megatron.megatron as dm
    from dion3_megatron.megatron import arguments

    megatron = options.options_for(options.MEGATRON)
    _assert_signature_is_the_spec(dm.MegatronDion3, options.MEGATRON)
    parser = arguments.add_dion3_arguments(argparse.ArgumentParser())
    parsed = vars(parser.parse_args([]))
    # (a momentum_dtype flag not given is unset: Megatron's --exp-avg-dtype may set it)
    assert parsed == {f"dion3_{o.name}": None if o.kind == options.STORAGE_DTYPE else o.default for o in megatron}
    flags = {s for action in parser._actions for s in action.option_strings}
    for option in megatron:
        assert arguments.flag(option.name) in flags
        if option.kind in (options.REAL, options.FRACTION, options.CHOICE, options.STORAGE_DTYPE):
            with pytest.raises(SystemExit):
                parser.parse_args([arguments.flag(option.name), str(_BAD[option.kind])])
    kwargs = dm.config_to_kwargs(SimpleNamespace(lr=None, weight_decay=0.1), [], None)
    assert {k: kwargs[k] for k in options.defaults_for(options.MEGATRON)} == options.defaults_for(options.MEGATRON)
    for option in megatron:
        config = SimpleNamespace(lr=None, weight_decay=0.1, **{f"dion3_{option.name}": _BAD[option.kind]})
        with pytest.raises(ValueError, match=f"dion3_{option.name} must be"):
            dm.config_to_kwargs(config, [], None)


def _trained(generator: torch.Generator, steps: int = 3, step=None, **settings) -> list[torch.Tensor]:
    """A tiny model's parameters after ``steps`` steps of Dion3 with ``settings`` (``step(opt)``
    runs a step, default ``opt.step()``), on gradients drawn from a copy of ``generator``."""
    draw = torch.Generator().manual_seed(generator.initial_seed())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=draw))
    opt = Dion3(model.parameters(), fraction=0.5, **settings)
    run = step(opt) if step is not None else opt.step
    for _ in range(steps):
        model(torch.randn(3, 8, generator=draw)).square().sum().backward()
        run()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_ns_dtype_is_taken_by_name_as_by_torch_dtype(generator):
    """ns_dtype by name (as the DeepSpeed config spells it) is its torch.dtype, in the constructor,
    a param group and the rule's settings; a name that is none of them is refused, saying both
    spellings."""
    for name, dtype in options.NS_DTYPES.items():
        assert options.hyperparameters(ns_dtype=name).ns_dtype is dtype
        Dion3([torch.nn.Parameter(torch.randn(4, 4, generator=generator))], ns_dtype=name)
    _assert_equal(_trained(generator, ns_dtype="float64"), _trained(generator, ns_dtype=torch.float64))
    p = torch.nn.Parameter(torch.randn(4, 4, generator=generator))
    opt = Dion3([{"params": [p], "ns_dtype": "float64"}])
    p.grad = torch.randn(4, 4, generator=generator)
    opt.step()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "ns_dtype must be None, or one of ('float16', 'bfloat16', 'float32', 'float64') by name or as a torch.dtype, got 'fp16'"
        ),
    ):
        Dion3([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype="fp16")


@pytest.mark.parametrize("option", [o for o in options.OPTIONS if o.kind in (options.DTYPE, options.CHOICE)], ids=lambda o: o.name)
def test_a_choice_message_names_exactly_what_the_option_takes(option):
    """Every value the message of a DTYPE or CHOICE option lists is taken, and what it lists is all
    that is taken."""
    listed = re.findall(r"'(\w+)'", option.allowed())
    takes = list(options.NS_DTYPES) if option.kind == options.DTYPE else list(option.choices)
    assert listed == takes
    assert all(option.valid(value) for value in listed)
    assert ("None" in option.allowed()) == option.valid(None) == (option.default is None)
    if option.kind == options.DTYPE:
        assert all(option.valid(dtype) for dtype in options.NS_DTYPES.values())
        assert "torch.dtype" in option.allowed() and not option.valid(torch.int32)


def test_a_tensor_lr_steps_as_its_number(generator):
    """torch's optimizers take a 0-d tensor lr: so does Dion3, for the matrices and the AdamW tensors
    alike, and a step with it is the step with its number."""
    _assert_equal(_trained(generator, lr=torch.tensor(0.02), adamw_lr=torch.tensor(0.003)), _trained(generator, lr=0.02, adamw_lr=0.003))
    assert options.hyperparameters(lr=torch.tensor(0.5)).lr == 0.5


@pytest.mark.parametrize("name", ["lr", "adamw_lr"])
@pytest.mark.parametrize(
    "bad",
    [torch.tensor(float("nan")), torch.tensor(-0.1), torch.tensor([0.01]), torch.tensor(1)],
    ids=["nan", "negative", "1-d", "integer"],
)
def test_a_tensor_lr_is_checked_as_a_number(name, bad):
    with pytest.raises(
        ValueError,
        match=re.escape(f"{name} must be a finite number >") + ".*" + re.escape(", or a 0-d floating tensor holding one, got tensor("),
    ):
        Dion3([torch.nn.Parameter(torch.zeros(4, 4))], **{name: bad})


@pytest.mark.slow  # the first torch.compile of a process loads dynamo and inductor: over a second
def test_a_compiled_step_is_the_eager_step(generator):
    """torch.compile(opt.step) runs the step eagerly (the step is excluded from tracing) and steps
    exactly as the eager step, past the first step, whose state the later ones update in place."""
    _assert_equal(_trained(generator, step=lambda opt: torch.compile(opt.step)), _trained(generator))


def test_an_optimizer_wide_option_in_a_param_group_is_refused_saying_where_it_goes():
    """A param group that sets an option of one value per optimizer is refused, not ignored: the
    group's adamw_lr would otherwise leave its lr at the optimizer's, kernels and cuda_graph at
    theirs."""
    w, b = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    adamw = {"params": [b], "algorithm": "adamw"}
    words = "param group 1: 'adamw_lr' is one value per optimizer, not per param group: set 'lr' in that group"
    with pytest.raises(ValueError, match=words):
        Dion3([{"params": [w]}, {**adamw, "adamw_lr": 0.5, "kernels": "bogus", "cuda_graph": "maybe"}], lr=0.01)
    for key, value in (("kernels", "torch"), ("cuda_graph", False)):
        words = f"param group 1: '{key}' is one value per optimizer.* set it in Dion3\\(\\.\\.\\., name=value\\)"
        with pytest.raises(ValueError, match=words):
            Dion3([{"params": [w]}, {**adamw, key: value}])
    opt = Dion3([{"params": [w]}, {**adamw, "lr": 0.5}])  # what the message says to do
    assert opt.param_groups[1]["lr"] == 0.5
    with pytest.raises(options.UnknownOptionError, match="'split_qkv' is not a Dion3 option here"):
        Dion3([{"params": [w], "split_qkv": False}])


def test_deepspeed_groups_refuse_optimizer_wide_options_too():
    from support.deepspeed_helpers import import_keeping_environment

    DeepSpeedDion3 = import_keeping_environment("dion3_megatron.deepspeed").DeepSpeedDion3
    w = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match='\'kernels\' is one value per optimizer.*the config\'s "optimizer" "params"'):
        DeepSpeedDion3([{"params": [w], "kernels": "torch"}])


def test_every_fraction_error_names_auto():
    """A fraction that is neither a number in (0, 1] nor 'auto' is refused saying 'auto' is one,
    in every front end's spelling: keyword, DeepSpeed config, Megatron flag and config field."""
    from support.deepspeed_helpers import import_keeping_environment

    words = "fraction must be in (0, 1] or 'auto', got 'abc'"
    with pytest.raises(ValueError, match=re.escape(words)):
        Dion3([torch.nn.Parameter(torch.zeros(4, 4))], fraction="abc")
    with pytest.raises(ValueError, match=re.escape(words)):
        import_keeping_environment("dion3_megatron.deepspeed").normalize_params({"fraction": "abc"})
    parse = options.BY_NAME["fraction"].argparse_type()
    for text, value in (("abc", "'abc'"), ("1.5", "1.5")):
        with pytest.raises(Exception, match=re.escape(f"fraction must be in (0, 1] or 'auto', got {value}")):
            parse(text)
    assert parse("auto") == "auto" and parse("0.25") == 0.25


def test_a_step_checks_settings_only_where_they_changed(monkeypatch, generator):
    """The step resolves each group's settings where they enter: a step with the groups unchanged
    checks nothing again; a scheduled lr is checked alone; an edited setting is checked again (and
    refused before anything changes)."""
    p = torch.nn.Parameter(torch.randn(8, 8, generator=generator))
    opt = Dion3([p], fraction=0.5)
    p.grad = torch.randn(8, 8, generator=generator)
    opt.step()
    checked: list[dict] = []
    check = options.check
    monkeypatch.setattr(options, "check", lambda where, prefix="", **values: (checked.append(values), check(where, prefix, **values))[1])
    opt.step()
    assert checked == []
    opt.param_groups[0]["lr"] = 0.02
    opt.step()
    assert checked == [{"lr": 0.02, "weight_decay": options.BY_NAME["weight_decay"].default}]
    opt.param_groups[0]["fraction"] = 2.0
    before = p.detach().clone()
    with pytest.raises(ValueError, match="param group 0: fraction must be"):
        opt.step()
    assert torch.equal(p.detach(), before)
