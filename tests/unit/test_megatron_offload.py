"""Megatron's optimizer offload for --optimizer dion3 (dion3_megatron/megatron/offload.py): what
reaches MegatronDion3, what Megatron-LM's checks see, what is refused in one line, and the
offloaded MegatronDion3 step (the CPU standing in for the GPU) against the step without offload.
Through pretrain(): tests/integration/test_megatron_pretrain.py."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

from dion3_megatron.engine import offload as engine_offload  # noqa: E402
from dion3_megatron.megatron import offload, registry  # noqa: E402
from unit.test_megatron_optimizer import _megatron, _params  # noqa: E402


def args(**given) -> argparse.Namespace:
    """Megatron-LM's args as its parser leaves them for a Dion3 run (dtypes still names)."""
    values = dict(
        optimizer="dion3",
        optimizer_cpu_offload=False,
        optimizer_offload_fraction=1.0,
        use_precision_aware_optimizer=False,
        use_torch_optimizer_for_cpu_offload=False,
        use_torch_fsdp2=False,
        exp_avg_dtype="fp32",
        exp_avg_sq_dtype="fp32",
        main_params_dtype="fp32",
        main_grads_dtype="fp32",
    )
    return argparse.Namespace(**{**values, **given})


def test_validation_lifts_megatrons_offload_check_for_dion3_and_leaves_the_flags_as_given():
    seen = {}

    def validate_args(a, defaults={}):  # noqa: B006 - Megatron's signature
        if a.optimizer_cpu_offload:  # what Megatron-LM asserts
            assert a.use_precision_aware_optimizer
        seen.update(vars(a))
        return a

    validate = registry.validation(validate_args)
    for precision_aware in (True, False):  # as Megatron asks, and the offload flag alone
        given = args(optimizer_cpu_offload=True, use_precision_aware_optimizer=precision_aware)
        assert validate(given) is given
        assert seen["use_precision_aware_optimizer"] is True and seen["optimizer_cpu_offload"] is True
        assert given.optimizer_cpu_offload is True and given.use_precision_aware_optimizer is precision_aware
    # Another optimizer's arguments reach Megatron's checks as they are.
    adam = args(optimizer="adam", optimizer_cpu_offload=True, use_precision_aware_optimizer=False)
    with pytest.raises(AssertionError):
        validate(adam)


@pytest.mark.parametrize(
    "given, line",
    [
        (dict(exp_avg_sq_dtype=torch.float16), "--exp-avg-sq-dtype must be fp32, got fp16"),
        (dict(main_params_dtype="fp16"), "--main-params-dtype must be fp32, got fp16"),
        (dict(use_torch_optimizer_for_cpu_offload=True), "--optimizer dion3: --use-torch-optimizer-for-cpu-offload must be False"),
        (
            dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
            "--optimizer dion3 offloads all of its state or none: --optimizer-offload-fraction must be 1.0 (or 0: none), got 0.5",
        ),
        (dict(optimizer_cpu_offload=True, use_torch_fsdp2=True), "drop --optimizer-cpu-offload"),
    ],
)
def test_what_dion3_cannot_take_stops_the_run_in_one_line(given, line):
    with pytest.raises(SystemExit) as stopped:
        registry.validation(lambda a: a)(args(**given))
    assert line in str(stopped.value) and "\n" not in str(stopped.value)


def test_the_config_hands_the_offload_to_dion3_and_refuses_a_partial_one():
    from megatron.core.optimizer import OptimizerConfig

    def kwargs(**given):
        return registry.config_to_kwargs(OptimizerConfig(optimizer="dion3", lr=0.01, **given), [], None)

    assert kwargs()["offload"] is False
    assert kwargs(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)["offload"] is True
    assert kwargs(optimizer_cpu_offload=True, optimizer_offload_fraction=0.0)["offload"] is False  # none offloaded, as Megatron's
    with pytest.raises(ValueError, match="optimizer_offload_fraction must be 1.0 \\(or 0: none\\), got 0.25"):
        kwargs(optimizer_cpu_offload=True, optimizer_offload_fraction=0.25)


def test_megatrons_adam_part_is_built_without_the_offload_dion3_takes():
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(optimizer="dion3", optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    built = offload.adam_part_on_device(lambda **kw: kw["config"])(config=config, param_groups=[])
    assert built.optimizer_cpu_offload is False and built.optimizer == "dion3"
    assert config.optimizer_cpu_offload is True  # (a copy: the run's config keeps it)


def _stepped(offload: bool, momentum_dtype: str):
    """test_megatron_optimizer's fused QKV (its rows permuted around the step), fc1 and projection,
    stepped 3 times."""
    params, names = _params(torch.Generator().manual_seed(0))
    opt = _megatron(params, names, offload=offload, momentum_dtype=momentum_dtype)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


@pytest.mark.parametrize("momentum_dtype", ["fp32", "bf16"])
def test_an_offloaded_megatron_dion3_steps_and_saves_as_without_offload(monkeypatch, momentum_dtype):
    monkeypatch.setattr(engine_offload, "step_device", lambda on, device: torch.device("cpu") if on else None)
    params, opt = _stepped(False, momentum_dtype)
    offloaded, opt_offloaded = _stepped(True, momentum_dtype)
    assert opt_offloaded._session.engine.offload == torch.device("cpu") and opt._session.engine.offload is None
    for a, b in zip(params, offloaded):
        assert torch.equal(a, b)
    saved, saved_offloaded = opt.state_dict(), opt_offloaded.state_dict()
    assert saved["param_groups"][0].get("rounding_step") == saved_offloaded["param_groups"][0].get("rounding_step")
    saved, saved_offloaded = saved["state"], saved_offloaded["state"]
    assert saved[0]["momentum"].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[momentum_dtype]
    for i, state in saved.items():
        for key, value in state.items():
            assert torch.equal(value, saved_offloaded[i][key]), (i, key)
