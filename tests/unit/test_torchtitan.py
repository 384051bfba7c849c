"""Dion3 in torchtitan 0.3: "Dion3" as an optimizer name of its param-group config
(dion3_megatron.torchtitan), the optimizer built by its OptimizersContainer, its llama3 model
parallelized by its own parallelize_llama on gloo (FSDP2, HSDP, FSDP2 with tensor parallelism),
checkpoints through its CheckpointManager; every run equal to the single-process Dion3 (and
AdamW) on the whole model."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("torchtitan.components.optimizer")

from support import torchtitan_helpers as helpers  # noqa: E402
from support.dist_utils import run_distributed  # noqa: E402
from support.equality import assert_equal  # noqa: E402
from support.torchtitan_helpers import SETTINGS  # noqa: E402

from dion3_megatron import Dion3  # noqa: E402
from dion3_megatron.options import UnknownOptionError  # noqa: E402
from dion3_megatron import torchtitan as dion3_torchtitan  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402

MATRICES = {
    f"layers.{i}.{m}.weight"
    for i in range(helpers.LAYERS)
    for m in ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
}


@pytest.fixture
def registered():
    dion3_torchtitan.register()
    yield
    dion3_torchtitan.unregister()


def test_register_is_idempotent_and_unregister_restores_torchtitans_resolver():
    dion3_torchtitan.unregister()  # (an earlier test of the process may have registered)
    stock = OptimizersContainer.__dict__["_resolve_optimizer_factory"].__func__
    try:
        dion3_torchtitan.register()
        dion3_torchtitan.register()
        resolve = OptimizersContainer._resolve_optimizer_factory
        assert resolve("Dion3") is dion3_torchtitan.build_dion3 and resolve("AdamW") is torch.optim.AdamW
        assert resolve.__wrapped__ is stock  # registered once, not wrapped twice
    finally:
        dion3_torchtitan.unregister()
        dion3_torchtitan.unregister()
    assert OptimizersContainer.__dict__["_resolve_optimizer_factory"].__func__ is stock
    assert not dion3_torchtitan.is_registered()
    with pytest.raises(NotImplementedError, match="Optimizer Dion3 not added"):
        OptimizersContainer._resolve_optimizer_factory("Dion3")


def test_the_default_config_gives_the_hidden_matrices_to_dion3_and_the_rest_to_adamw(registered):
    model = helpers.built_model()
    optimizers, rule, adamw = helpers.one_dion3(model, SETTINGS, MATRICES)
    assert {g["lr"] for g in rule} == {0.02} and {g["lr"] for g in adamw} == {0.003}
    assert len(rule) == len(MATRICES) and len(adamw) == 1  # a group per matrix (its record of f); AdamW's whole
    before = helpers.full_params(model)
    flat = optimizers.state_dict()  # torchtitan first steps a fresh optimizer with zero gradients at lr 0
    assert flat["state.layers.0.attention.wo.weight.momentum"].shape == (helpers.DIM, helpers.DIM)
    assert all(torch.equal(p, before[n]) for n, p in helpers.full_params(model).items())


def test_the_default_regex_names_the_matrices_of_torchtitans_llama3_wherever_wrappers_put_them():
    from torchtitan.models.llama3 import llama3_configs

    with torch.device("meta"):
        model = llama3_configs["debugmodel"](attn_backend="flex").build()
    chosen = {n for n, _ in model.named_parameters() if re.search(dion3_torchtitan.HIDDEN_MATRICES, n)}
    assert {n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers.")} == chosen
    assert len(chosen) == 6 * 5
    for name in (
        "layers.0._checkpoint_wrapped_module.attention.wo.weight",
        "layers.3.attention.qkv_linear.wq.weight",
        "layers.3.attention.qkv_linear.wk.weight",
        "layers.3.attention.qkv_linear.wv.weight",
    ):
        assert re.search(dion3_torchtitan.HIDDEN_MATRICES, name), name
    for name in (
        "layers.0.attention.q_norm.weight",
        "layers.0.attention_norm.weight",
        "tok_embeddings.weight",
        "lm_head.weight",
        "norm.weight",
        "layers.0.attention.wo.bias",
    ):
        assert not re.search(dion3_torchtitan.HIDDEN_MATRICES, name), name


def test_the_trainer_configs_name_dion3_and_register_it():
    from dion3_megatron.torchtitan import config_registry  # imports torchtitan's trainer: its packages are the tests' install

    try:
        for make in (config_registry.llama3_debugmodel_dion3, config_registry.llama3_8b_dion3):
            dion3_torchtitan.unregister()
            groups = make().optimizer.param_groups
            assert dion3_torchtitan.is_registered()
            assert [(g.pattern, g.optimizer_name) for g in groups] == [(dion3_torchtitan.HIDDEN_MATRICES, "Dion3"), (".*", "Dion3")]
            assert groups[1].optimizer_kwargs["algorithm"] == "adamw"
    finally:
        dion3_torchtitan.unregister()


def test_a_non_finite_gradient_of_an_adamw_tensor_skips_the_whole_step(registered):
    """One Dion3 holds the matrices and the AdamW tensors: a NaN in an embedding's gradient leaves
    every weight and state as it was, and is counted; the same step without it changes weights."""
    model = helpers.built_model()
    optimizers = helpers.container(model, SETTINGS)
    with pytest.warns(RuntimeWarning, match="non-finite gradient, step skipped"):
        assert helpers.poisoned_step([model], optimizers, poison=True) == {"unchanged": True, "skipped": [1]}
    assert not optimizers.optimizers[0].state  # no state made either
    assert helpers.poisoned_step([model], optimizers, poison=False) == {"unchanged": False, "skipped": [1]}


def _built_with(kwargs: dict, factory: dict | None = None):
    config = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=dion3_torchtitan.HIDDEN_MATRICES, optimizer_name="Dion3", optimizer_kwargs=kwargs),
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
        ],
        optimizer_factory_kwargs_by_name={"Dion3": factory or {}},
    )
    return config.build(model_parts=[helpers.built_model()])


def test_options_are_checked_by_dion3s_spec_with_the_closest_name(registered):
    with pytest.raises(UnknownOptionError, match=r"'fracton' is not a Dion3 option here \(did you mean 'fraction'\?\)"):
        dion3_torchtitan.optimizer_config(fracton=0.5)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\] or 'auto', got 2"):
        dion3_torchtitan.optimizer_config(fraction=2)
    with pytest.raises(
        UnknownOptionError,
        match=r"Dion3 optimizer_kwargs of 'layers.0.attention.qkv_linear.wqkv.weight' and "
        r"others: 'fracton' is not a Dion3 option here \(did you mean 'fraction'\?\)",
    ):
        _built_with({"lr": 0.01, "fracton": 0.5})
    with pytest.raises(UnknownOptionError, match=r"'momentum' is not a Dion3 option here \(Dion3 calls its momentum 'mu'\)"):
        _built_with({"lr": 0.01, "momentum": 0.9})
    with pytest.raises(UnknownOptionError, match=r"'foo' is not a Dion3 option here; the options here are lr, fraction"):
        _built_with({"lr": 0.01, "foo": 1})
    with pytest.raises(
        ValueError,
        match=r"'cuda_graph' is one value per optimizer, not per param group: set it in the config's "
        r"optimizer_factory_kwargs_by_name\['Dion3'\]",
    ):
        _built_with({"lr": 0.01, "cuda_graph": False})
    with pytest.raises(UnknownOptionError, match=r"Dion3: 'cuda_grph' is not a Dion3 option here \(did you mean 'cuda_graph'\?\)"):
        _built_with({"lr": 0.01}, {"cuda_grph": False})
    with pytest.raises(ValueError, match=r"param group 0 \('layers.0.attention.qkv_linear.wqkv.weight'\): mu must be in \[0, 1\), got 1.5"):
        _built_with({"lr": 0.01, "mu": 1.5})
    assert isinstance(_built_with({"lr": 0.01, "mu": 0.5}, {"cuda_graph": False}).optimizers[0], Dion3)


def test_a_checkpoint_keeps_the_automatic_fraction_each_matrix_stepped_at(registered, monkeypatch):
    """torchtitan's flat state dict keys each parameter's group settings by its name, and loads only
    the keys a live group has: the record of the automatic f must be one of them."""
    from dion3_megatron.core import cost_model
    from dion3_megatron.engine import fractions

    monkeypatch.setattr(cost_model, "TOKENS_PER_STEP", 0)  # the optimizer's step is the whole iteration
    monkeypatch.setattr(cost_model, "MIN_SELECTED_ROWS", 8)  # f < 1 offered for these small matrices

    def trained(speed: cost_model.DeviceSpeed):
        monkeypatch.setattr(fractions, "measure", lambda device, dtype: speed)
        model = helpers.built_model()
        optimizers = helpers.container(model, {**SETTINGS, "fraction": "auto"})
        helpers.train(model, optimizers, range(1))
        return optimizers

    saved = trained(cost_model.DeviceSpeed(1e6, 0.0, 1e30, 1e30))
    flat = saved.state_dict()
    chosen = dict(saved.optimizers[0].fractions)
    assert set(chosen) == MATRICES and min(chosen.values()) < 1, chosen  # FLOP-bound: f < 1
    assert flat["param_groups.layers.1.feed_forward.w2.weight.fractions"] == {
        "layers.1.feed_forward.w2.weight": chosen["layers.1.feed_forward.w2.weight"]
    }
    resumed = trained(cost_model.DeviceSpeed(1e30, 1.0, 1e30, 1e30))  # launch-bound: larger f
    assert dict(resumed.optimizers[0].fractions) != chosen
    resumed.load_state_dict(flat)
    model = resumed.model_parts[0]
    helpers.train(model, resumed, range(1, 2))
    assert dict(resumed.optimizers[0].fractions) == chosen


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(
        helpers.session, 2, list(helpers.LAYOUTS), SETTINGS, str(tmp_path_factory.mktemp("torchtitan-checkpoint")), timeout=600
    )


@pytest.mark.slow
def test_each_layout_of_parallelize_llama_steps_as_the_single_process_run(two_ranks):
    expected = two_ranks[1]["reference"]
    for out in two_ranks:
        for layout, case in zip(helpers.LAYOUTS, out["cases"]):
            assert case["types"] == ["Dion3"]
            assert_equal(case["params"], expected, layout)


@pytest.mark.slow
def test_a_checkpoint_of_checkpoint_manager_resumes_as_the_uninterrupted_run_at_two_ranks_and_at_one(two_ranks):
    expected = two_ranks[1]["reference"]
    for out in two_ranks:
        for layout in helpers.LAYOUTS:
            assert_equal(out["resumed"][layout], expected, f"{layout} resumed at 2 ranks")
    for layout in helpers.LAYOUTS:
        assert_equal(two_ranks[0]["resumed at one rank"][layout], expected, f"{layout} resumed at 1 rank")


# How far a run with a bf16 momentum may lie from the single process's, relative to how far the
# matrices moved. Its stochastic rounding turns the fp32 rounding of FSDP's summed gradients (added in
# another order than one process adds them) into whole bf16 steps of some momentum entries: the runs
# part by 0.5-0.8 % after three steps (f = 1/2, 1); with an fp32 momentum 4e-6 and 9e-6.
BF16_APART = 0.05


@pytest.mark.slow
def test_optimizer_config_with_a_bf16_momentum_steps_and_resumes_under_fsdp2(tmp_path):
    """``optimizer_config(momentum_dtype="bf16")``: the container's Dion3 keeps each matrix's
    momentum in bf16 with its count of steps (the AdamW tensors' state stays fp32) and steps near
    the single process with a bf16 momentum; CheckpointManager's checkpoint resumes it bit for bit at
    two ranks, and at one rank as the uninterrupted run (a lost count of steps would round the last
    step with other bits)."""
    settings = {**SETTINGS, "momentum_dtype": "bf16"}
    outs = run_distributed(helpers.session, 2, ["fsdp"], settings, str(tmp_path), timeout=600)
    expected, start = outs[1]["reference"], dict(helpers.built_model().named_parameters())
    for out in outs:
        (case,) = out["cases"]
        dtypes = case["state dtypes"]
        assert {n for n, dtype in dtypes.items() if dtype == torch.bfloat16} == {f"{m}.momentum" for m in MATRICES}, dtypes
        assert {n for n, dtype in dtypes.items() if dtype == torch.int64} == {f"{m}.rounding_step" for m in MATRICES}, dtypes
        assert {dtype for n, dtype in dtypes.items() if "exp_avg" in n} == {torch.float32}, dtypes
        for name, value in case["params"].items():
            apart = (value - expected[name]).norm() / (expected[name] - start[name]).norm()
            assert apart <= BF16_APART, (name, apart)
        assert all(torch.equal(value, case["params"][n]) for n, value in out["resumed"]["fsdp"].items())
    assert_equal(outs[0]["resumed at one rank"]["fsdp"], outs[0]["cases"][0]["params"], "fsdp, bf16 momentum, resumed at 1 rank")


def test_the_trainer_benchmark_reads_torchtitan_s_step_lines_and_writes_its_corpus(tmp_path):
    """benchmarks/bench_torchtitan.py reads the lines torchtitan's MetricsProcessor.log prints
    (colours included) and leaves validation lines out; its corpus is JSON lines of the standard
    library's sources, one file a line, as torchtitan's c4_test loader reads them."""
    import json

    from benchmarks import bench_torchtitan as bench
    from examples.stdlib_text import stdlib_files, write_stdlib_corpus

    red, green, reset = "\x1b[31m", "\x1b[32m", "\x1b[39m"
    log = "\n".join(
        [
            f"[rank0]: {red}step:  1  {green}loss: 10.87654  grad_norm:  2.1000  memory:  1.20GiB(1.51%)  "
            f"tps: 1,234  tflops: 0.10  mfu: 0.01%{reset}",
            f"[rank0]: {red}step: 12  {green}loss:  7.50000  grad_norm:  0.5000  memory:  1.20GiB(1.51%)  "
            f"tps: 98,765  tflops: 3.20  mfu: 0.32%{reset}",
            "[rank0]: validate step:  5  loss:  8.0000  memory:  1.20GiB(1.51%)  tps: 55,555",
            "[rank0]: a line with no step",
        ]
    )
    assert bench.steps_of(log) == {1: (10.87654, 1234.0), 12: (7.5, 98765.0)}
    lines = (write_stdlib_corpus(tmp_path / "c4_test") / "data.json").read_text().splitlines()
    files = stdlib_files()
    assert len(lines) == len(files) > 100
    assert json.loads(lines[0]) == {"text": files[0].read_text(errors="replace")}
