"""Dion3's DeepSpeed config block: validation, JSON spellings, registration, param groups (no processes)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from support.deepspeed_helpers import import_keeping_environment
from support.repository import ROOT
from dion3_megatron.frontend.groups import algorithm_of
from dion3_megatron.options import UnknownOptionError

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs deepspeed", allow_module_level=True)

dion3_ds = import_keeping_environment("dion3_megatron.deepspeed")
DeepSpeedDion3, normalize_params = dion3_ds.DeepSpeedDion3, dion3_ds.normalize_params

EXAMPLES = ROOT / "examples" / "deepspeed"


def test_registration_exposes_the_class_where_deepspeed_looks():
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    assert dion3_ds.register() is DeepSpeedDion3
    # DeepSpeed lower-cases a config "type" among its own optimizers' names, then looks it up in torch.optim
    assert DEEPSPEED_OPTIMIZERS.count("dion3") == 1
    assert torch.optim.dion3 is DeepSpeedDion3
    assert ZERO_SUPPORTED_OPTIMIZERS.count(DeepSpeedDion3) == 1
    dion3_ds.register()  # idempotent
    assert ZERO_SUPPORTED_OPTIMIZERS.count(DeepSpeedDion3) == 1 and DEEPSPEED_OPTIMIZERS.count("dion3") == 1


def test_the_stage_hook_makes_the_same_object_the_zero_class_before_any_step():
    from dion3_megatron.deepspeed.base import become

    opt = DeepSpeedDion3([torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))])
    become(opt, dion3_ds.DeepSpeedZeroDion3)
    assert type(opt) is dion3_ds.DeepSpeedZeroDion3 and not isinstance(opt, DeepSpeedDion3)
    become(opt, DeepSpeedDion3)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="cannot become a DeepSpeedZeroDion3"):
        become(opt, dion3_ds.DeepSpeedZeroDion3)


def test_stage0_keeps_the_record_in_each_param_group_and_checks_it_on_load():
    matrix, bias = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    opt = DeepSpeedDion3([matrix, bias], fraction=0.5)
    matrix.grad, bias.grad = torch.randn(4, 4), torch.randn(4)
    opt.step()
    sd = opt.state_dict()
    assert sorted(sd) == ["param_groups", "skipped_steps", "state"]  # no record outside the groups
    assert [g["fractions"] for g in sd["param_groups"]] == [{}, {}]  # no automatic f here
    sd["param_groups"][0]["fractions"] = {"group0.param0": 0.3}
    before = matrix.detach().clone()
    with pytest.raises(ValueError, match=r"param group 0: 'group0.param0' has fraction 0.3"):
        opt.load_state_dict(sd)
    assert torch.equal(matrix, before)


def test_json_spellings_are_converted():
    out = normalize_params({"betas": [0.9, 0.99], "ns_dtype": "bfloat16", "fraction": 0.125, "num_heads": None, "mu": None})
    assert out["betas"] == (0.9, 0.99) and out["ns_dtype"] is torch.bfloat16
    opt = DeepSpeedDion3([torch.nn.Parameter(torch.zeros(4, 4))], **{"betas": [0.8, 0.9], "ns_dtype": "float64"})
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["ns_dtype"] is torch.float64
    assert normalize_params({"fraction": "auto"})["fraction"] == "auto"


def test_adamw_lr_sets_the_lr_of_the_adamw_parameters_only():
    matrix, bias = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    opt = DeepSpeedDion3([matrix, bias], lr=0.02, adamw_lr=0.002)
    lrs = {id(p): (g["lr"], algorithm_of(g, p)) for g in opt.param_groups for p in g["params"]}
    assert lrs == {id(matrix): (0.02, "dion3"), id(bias): (0.002, "adamw")}
    embed = torch.nn.Parameter(torch.randn(8, 4))
    groups = [
        {"params": [matrix], "algorithm": "dion3"},
        {"params": [embed], "algorithm": "adamw"},
        {"params": [bias], "algorithm": "adamw", "lr": 0.001},
    ]
    opt = DeepSpeedDion3(groups, lr=0.02, adamw_lr=0.002)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.002, 0.001]


@pytest.mark.parametrize(
    "params, words",
    [
        ({"momentum": 0.9}, ["'momentum'", "'mu'"]),
        ({"lr": 0.1, "fractoin": 0.5}, ["'fractoin'", "did you mean 'fraction'"]),
        ({"max_grad_norm": 1.0}, ["gradient_clipping"]),
        ({"torch_adam": True}, ["torch_adam"]),
        ({"adam_lr": 0.002}, ["'adam_lr'", "Dion3 calls it 'adamw_lr'"]),
    ],
)
def test_unknown_params_raise_the_unknown_option_error(params, words):
    with pytest.raises(UnknownOptionError) as info:
        DeepSpeedDion3([torch.nn.Parameter(torch.zeros(4, 4))], **params)
    message = str(info.value)
    assert '"type": "Dion3"' in message
    for w in words:
        assert w in message, (w, message)


@pytest.mark.parametrize(
    "params, words",
    [
        ({"fraction": 0}, ["fraction must be in (0, 1] or 'auto'"]),
        ({"fraction": 1.5}, ["fraction must be in (0, 1] or 'auto'"]),
        ({"fraction": "half"}, ["fraction must be in (0, 1] or 'auto', got 'half'"]),
        ({"adamw_lr": 0}, ["adamw_lr must be a finite number > 0"]),
        ({"mu": 1.0}, ["mu must be in [0, 1)"]),
        ({"beta2": -0.1}, ["beta2 must be in [0, 1)"]),
        ({"lr": -1}, ["lr must be a finite number >= 0"]),
        ({"lr": True}, ["lr must be a finite number"]),
        ({"lr": float("nan")}, ["lr must be a finite number"]),
        ({"weight_decay": "0.1"}, ["weight_decay must be a finite number"]),
        ({"eps": 0}, ["eps must be a finite number > 0"]),
        ({"betas": [0.9, 1.0]}, ["betas must be two values in [0, 1)"]),
        ({"betas": 0.9}, ["betas must be two values"]),
        ({"adjust_lr": "spectral"}, ["adjust_lr must be one of"]),
        ({"ns_method": "svd"}, ["ns_method must be one of"]),
        ({"ns_dtype": "fp16"}, ["ns_dtype must be None, or one of"]),
        ({"num_heads": 0}, ["num_heads must be None or a positive int"]),
        ({"num_heads": True}, ["num_heads must be None or a positive int"]),
        ({"scale_lr_by_fraction": "yes"}, ["scale_lr_by_fraction must be a bool"]),
        ({"scale_mu_by_fraction": 1}, ["scale_mu_by_fraction must be a bool"]),
        ({"scale_mu_by_fraction": True}, ["scale_mu_by_fraction=True scales an explicit mu, got mu=None"]),
        ({"mu": "0.9"}, ["mu must be in [0, 1), got '0.9'"]),
        ({"cuda_graph": "off"}, ["cuda_graph must be a bool"]),
    ],
)
def test_bad_params_raise_clear_errors(params, words):
    with pytest.raises(ValueError) as info:
        DeepSpeedDion3([torch.nn.Parameter(torch.zeros(4, 4))], **params)
    message = str(info.value)
    assert '"type": "Dion3"' in message
    for w in words:
        assert w in message, (w, message)


def test_num_heads_that_do_not_divide_a_matrix_are_refused_at_construction():
    matrix, bias = torch.nn.Parameter(torch.zeros(10, 4)), torch.nn.Parameter(torch.zeros(10))
    with pytest.raises(ValueError, match=r"num_heads=4 does not divide the 10 rows of param 0 \(shape \(10, 4\)\)"):
        DeepSpeedDion3([matrix, bias], num_heads=4)
    DeepSpeedDion3([matrix, bias], num_heads=5)  # divides; the bias takes AdamW


def test_stage0_single_process_equals_plain_dion3(generator):
    from dion3_megatron import Dion3

    data = [torch.randn(12, 20, generator=generator), torch.randn(20, generator=generator)]
    grads = [[torch.randn_like(d) for d in data] for _ in range(3)]
    results = []
    for cls, kwargs in ((Dion3, {"betas": (0.9, 0.95)}), (DeepSpeedDion3, {"betas": [0.9, 0.95]})):
        params = [torch.nn.Parameter(d.clone()) for d in data]
        opt = cls(params, lr=0.05, fraction=0.5, ns_dtype=torch.float64 if cls is Dion3 else "float64", **kwargs)
        for g in grads:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            opt.step()
        results.append(params)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_param_groups_put_embeddings_head_norms_and_vectors_on_adamw():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.fc = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.lm_head = torch.nn.Linear(8, 10, bias=False)
            self.frozen = torch.nn.Linear(8, 8)
            self.frozen.requires_grad_(False)

    m = M()
    groups = dion3_ds.param_groups(m, adamw={"weight_decay": 0.0})
    assert [g["algorithm"] for g in groups] == ["dion3", "adamw"]
    assert groups[0]["params"] == [m.fc.weight]
    assert {id(p) for p in groups[1]["params"]} == {
        id(m.embed.weight),
        id(m.fc.bias),
        id(m.norm.weight),
        id(m.norm.bias),
        id(m.lm_head.weight),
    }
    assert groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("name", ["ds_config_dion3.json"])
def test_example_config_is_valid(name):
    config = json.loads((EXAMPLES / name).read_text())
    assert config["optimizer"]["type"] == "Dion3"
    normalize_params(config["optimizer"]["params"])


def test_hf_trainer_example_config_is_auto_where_trainer_sets_values_and_valid_once_filled():
    path = EXAMPLES.parent / "hf_trainer" / "ds_config_dion3.json"
    config = json.loads(path.read_text())
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert config[key] == "auto", key
    assert config["bf16"]["enabled"] == "auto"
    params = config["optimizer"]["params"]
    assert params["lr"] == "auto" and params["weight_decay"] == "auto"
    filled = {k: {"lr": 0.02, "weight_decay": 0.0}.get(k, v) for k, v in params.items()}  # what Trainer writes
    assert normalize_params(filled)["lr"] == 0.02
