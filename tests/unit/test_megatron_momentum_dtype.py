"""MegatronDion3 with momentum_dtype="bf16" in one process (no torch.distributed), and how Megatron's
precision-aware optimizer sets it (dion3_megatron/megatron/precision.py): the step against the torch
Dion3's, the state dict (the momentum in bf16, the count of steps in the param groups), a resume,
checkpoints of the other dtype, the bytes of the state, and what Megatron's flags and config take
or refuse. Through pretrain(): tests/integration/test_megatron_pretrain.py."""

from __future__ import annotations

import argparse
import copy
import io
import re
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from dion3_megatron import Dion3  # noqa: E402
from dion3_megatron.megatron import precision, registry  # noqa: E402
from dion3_megatron.megatron.saved_state import ROUNDING_STEP  # noqa: E402
from unit.test_megatron_offload import args as megatron_args  # noqa: E402
from unit.test_megatron_optimizer import _clones, _grads, _megatron, _params, _split  # noqa: E402

BF16 = "bf16"


def _step(opt, params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def _resumable(params, names, **settings):
    """Parameters equal to ``params`` (their Megatron marks too) and a MegatronDion3 of them."""
    clones = _clones(params)
    return clones, _megatron(clones, {c: names[p] for c, p in zip(clones, params)}, **settings)


def _counts(opt) -> list[int]:
    """Every bf16 momentum's count of steps, as the engine holds it."""
    return [int(s.state[ROUNDING_STEP]) for shards in opt._shards.values() for s in shards]


def test_bf16_momentum_steps_as_the_torch_dion3_on_the_logical_matrices_bit_for_bit(generator):
    """The noise of the rounding is hashed from each logical matrix's name and the place of an
    entry in it: the torch Dion3 stepping Q, K, V, gate, up and the projection under the same names
    holds the same weights and bf16 momenta, to the bit, while fp32 momentum ends elsewhere."""
    params, names = _params(generator)
    fp32 = _clones(params)
    grads = _grads(generator, params, 4)
    opt = _megatron(params, names, momentum_dtype=BF16)
    leaves = {}
    for p in params:
        for matrix, piece in zip(opt.layout_of(p).matrices, _split(names[p], p.data)):
            leaves[names[p] + (f".{matrix.suffix}" if matrix.suffix else "")] = torch.nn.Parameter(piece.clone())
    ref = Dion3(list(leaves.items()), lr=0.05, weight_decay=0.1, fraction=0.5, momentum_dtype=BF16)
    for step_grads in grads:
        pieces = [piece for p, g in zip(params, step_grads) for piece in _split(names[p], g)]
        _step(ref, leaves.values(), pieces)
        _step(opt, params, step_grads)
    for p in params:
        for shard, got in zip(opt._shards[p], _split(names[p], p.data)):
            assert torch.equal(got, leaves[shard.name].data), shard.name
            assert shard.state["momentum"].dtype == torch.bfloat16
            assert torch.equal(shard.state["momentum"], ref.state[leaves[shard.name]]["momentum"]), shard.name
    fp32_opt = _megatron(fp32, {c: names[p] for c, p in zip(fp32, params)})
    for step_grads in grads:
        _step(fp32_opt, fp32, step_grads)
    assert max((p.data - c.data).abs().max() for p, c in zip(params, fp32)) > 0


def _saved(opt) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return buffer


def test_the_state_dict_holds_the_bf16_momentum_and_the_count_and_a_resume_is_bit_identical(generator):
    """After 2 steps and a skipped one: each parameter's momentum saved in bf16 at its shape, the
    count of steps (2: a skipped step counts nothing) in the param group, where every matrix's is;
    a new optimizer that loads it steps as the one that went on, bit for bit. With another count
    in the group the resumed steps draw other noise and end elsewhere."""
    params, names = _params(generator)
    grads = _grads(generator, params, 5)
    opt = _megatron(params, names, momentum_dtype=BF16)
    for step_grads in grads[:2]:
        _step(opt, params, step_grads)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        _step(opt, params, [torch.full_like(grads[2][0], float("nan")), *grads[2][1:]])
    assert _counts(opt) == [2] * 6
    weights = [p.data.clone() for p in params]
    sd = opt.state_dict()
    assert sd["param_groups"][0][ROUNDING_STEP] == 2 and sd["param_groups"][0]["momentum_dtype"] == BF16
    for index, p in enumerate(params):
        assert {k: (v.dtype, tuple(v.shape)) for k, v in sd["state"][index].items()} == {
            "momentum": (torch.bfloat16, tuple(p.shape)),
            "variance": (torch.float32, tuple(p.shape)),
            "row_age": (torch.float32, tuple(p.shape)),
        }
    buffer = _saved(opt)
    for step_grads in grads[3:]:
        _step(opt, params, step_grads)
    momenta = [v["momentum"] for v in opt.state_dict()["state"].values()]
    for count, same in ((None, True), (7, False)):
        buffer.seek(0)
        saved = torch.load(buffer)
        if count is not None:
            saved["param_groups"][0][ROUNDING_STEP] = count
        resumed, other = _resumable(params, names, momentum_dtype=BF16)
        for c, w in zip(resumed, weights):
            c.data.copy_(w)
        other.load_state_dict(saved)
        assert _counts(other) == [saved["param_groups"][0][ROUNDING_STEP]] * 6
        for step_grads in grads[3:]:
            _step(other, resumed, step_grads)
        equal = all(torch.equal(p.data, c.data) for p, c in zip(params, resumed)) and all(
            torch.equal(m, v["momentum"]) for m, v in zip(momenta, other.state_dict()["state"].values())
        )
        assert equal == same, count


def test_a_group_switched_to_bf16_converts_its_momentum_and_counts_on_from_the_optimizers_steps(generator):
    """momentum_dtype is a param-group setting: changed between steps, the engine is built anew
    with the state converted (the matrices' count of steps: the optimizer's), and back."""
    params, names = _params(generator)
    opt = _megatron(params, names)
    grads = _grads(generator, params, 4)
    for step_grads in grads[:2]:
        _step(opt, params, step_grads)
    before = [s.state["momentum"].clone() for shards in opt._shards.values() for s in shards]
    opt.param_groups[0]["momentum_dtype"] = BF16
    opt.init_state()
    after = [s.state["momentum"] for shards in opt._shards.values() for s in shards]
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b.bfloat16()) for a, b in zip(after, before))
    assert _counts(opt) == [2] * 6
    _step(opt, params, grads[2])
    assert _counts(opt) == [3] * 6 and opt.state_dict()["param_groups"][0][ROUNDING_STEP] == 3
    opt.param_groups[0]["momentum_dtype"] = "fp32"
    _step(opt, params, grads[3])
    shards = [s for shards in opt._shards.values() for s in shards]
    assert all(s.state["momentum"].dtype == torch.float32 and ROUNDING_STEP not in s.state for s in shards)
    assert ROUNDING_STEP not in opt.state_dict()["param_groups"][0]


@pytest.mark.parametrize("count", [-1, 1.5, True])
def test_a_count_of_steps_that_is_none_is_refused_before_anything_changes(generator, count):
    params, names = _params(generator)
    opt = _megatron(params, names, momentum_dtype=BF16)
    _step(opt, params, _grads(generator, params, 1)[0])
    sd = opt.state_dict()
    sd["param_groups"][0][ROUNDING_STEP] = count
    with pytest.raises(ValueError, match=f"param group 0: rounding_step must be an int >= 0, got {count!r}"):
        opt.load_state_dict(sd)
    assert _counts(opt) == [1] * 6


@pytest.mark.parametrize("saved_as, loaded_as", [("fp32", BF16), (BF16, "fp32")])
@pytest.mark.parametrize("delivered", ["as saved", "in the loader's dtype"])
def test_a_checkpoint_of_the_other_dtype_loads_converted_saying_so_once(generator, saved_as, loaded_as, delivered):
    """The loader keeps its momentum_dtype and converts the checkpoint's momentum, with one warning.
    Megatron's torch_dist load hands over the tensors in the dtype of the loader's own state ("in
    the loader's dtype"): the saved group's momentum_dtype still says what was converted. A bf16
    momentum loaded from fp32 counts its steps from 0."""
    params, names = _params(generator)
    grads = _grads(generator, params, 3)
    saver = _megatron(params, names, momentum_dtype=saved_as)
    for step_grads in grads[:2]:
        _step(saver, params, step_grads)
    saved = saver.state_dict()
    dtype = torch.bfloat16 if loaded_as == BF16 else torch.float32
    if delivered != "as saved":
        for entry in saved["state"].values():
            entry["momentum"] = entry["momentum"].to(dtype)
    clones, loader = _resumable(params, names, momentum_dtype=loaded_as)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(copy.deepcopy(saved))
    said = [str(w.message) for w in caught if "momentum was converted" in str(w.message)]
    was = torch.bfloat16 if saved_as == BF16 else torch.float32
    assert said == [
        f"Dion3: the checkpoint's momentum was converted ({was} to {dtype}) to the momentum_dtype of this optimizer's param groups"
    ]
    assert loader.param_groups[0]["momentum_dtype"] == loaded_as
    again = loader.state_dict()
    for index, entry in saved["state"].items():
        assert again["state"][index]["momentum"].dtype == dtype
        assert torch.equal(again["state"][index]["momentum"], entry["momentum"].to(dtype))
    assert again["param_groups"][0].get(ROUNDING_STEP) == (0 if loaded_as == BF16 else None)
    _step(loader, clones, grads[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same dtype: nothing to say
        _resumable(params, names, momentum_dtype=saved_as)[1].load_state_dict(copy.deepcopy(saver.state_dict()))


def test_a_checkpoint_whose_groups_name_no_momentum_dtype_held_fp32(generator):
    """A checkpoint written before momenta were bf16 names no momentum_dtype: fp32."""
    params, names = _params(generator)
    saver = _megatron(params, names)
    _step(saver, params, _grads(generator, params, 1)[0])
    saved = saver.state_dict()
    del saved["param_groups"][0]["momentum_dtype"]
    for entry in saved["state"].values():
        entry["momentum"] = entry["momentum"].bfloat16()  # (delivered in the loader's dtype)
    _, loader = _resumable(params, names, momentum_dtype=BF16)
    with pytest.warns(UserWarning, match=r"momentum was converted \(torch.float32 to torch.bfloat16\)"):
        loader.load_state_dict(saved)


def _state_bytes(opt) -> int:
    """Bytes of the engine's state of every matrix, each storage once."""
    storages = {}
    for shards in opt._shards.values():
        for shard in shards:
            for value in shard.state.values():
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("momentum_dtype, most", [(BF16, 2.1), ("fp32", 4.1)])
def test_bf16_momentum_halves_the_state_bytes_per_parameter(generator, momentum_dtype, most):
    """A fused QKV, a SwiGLU fc1 and a projection of 512 columns with staleness (the default): the
    momentum, per-row variance and ages, and with bf16 each matrix's count of steps."""
    qkv = torch.nn.Parameter(torch.randn(2 * 16, 512, generator=generator))
    qkv.is_qkv, qkv.qkv_split_shapes = True, [8, 4, 4]
    fc1, fc2 = (torch.nn.Parameter(torch.randn(rows, 512, generator=generator)) for rows in (64, 48))
    params = [qkv, fc1, fc2]
    names = {qkv: "layers.0.self_attention.linear_qkv.weight", fc1: "layers.0.mlp.linear_fc1.weight", fc2: "layers.0.mlp.linear_fc2.weight"}
    opt = _megatron(params, names, momentum_dtype=momentum_dtype)
    _step(opt, params, _grads(generator, params, 1)[0])
    per_parameter = _state_bytes(opt) / sum(p.numel() for p in params)
    assert most - 0.1 < per_parameter <= most
    matrices = sum(len(shards) for shards in opt._shards.values())  # Q, K, V, gate, up, fc2
    expected = {BF16: 2, "fp32": 4}[momentum_dtype] + 8 / 512 + 8 * matrices / sum(p.numel() for p in params) * (momentum_dtype == BF16)
    assert per_parameter == pytest.approx(expected)


# --------------------------------------------------------------------------------------------
# Megatron's precision-aware optimizer and --dion3-momentum-dtype.


def _config(**given):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(**{"optimizer": "dion3", "lr": 0.01, "use_distributed_optimizer": True, **given})


def test_the_precision_aware_optimizer_sets_the_momentum_dtype_of_dion3_and_of_dion3_alone():
    """Megatron-Core's OptimizerConfig takes use_precision_aware_optimizer for dion3 (stock 0.19
    asserts adam, and Transformer Engine's FusedAdam): exp_avg_dtype is the momentum's dtype;
    dion3_momentum_dtype says the same where given. Megatron's code builds from a view without the
    precision-aware optimizer (its Adam part keeps fp32 moments); other optimizers' checks are
    Megatron's."""
    bf16 = dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16)
    config = _config(**bf16)
    assert config.use_precision_aware_optimizer and config.exp_avg_dtype is torch.bfloat16  # as given
    assert registry.config_to_kwargs(config, [], None)["momentum_dtype"] == BF16
    view = precision.megatron_view(config)
    assert view is not config and view.dion3_momentum_dtype == BF16 and view.exp_avg_dtype is torch.float32
    assert not view.use_precision_aware_optimizer and not view.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    assert registry.config_to_kwargs(view, [], None)["momentum_dtype"] == BF16
    assert precision.megatron_view(plain := _config()) is plain
    assert registry.config_to_kwargs(plain, [], None)["momentum_dtype"] == "fp32"
    assert registry.config_to_kwargs(_config(use_precision_aware_optimizer=True), [], None)["momentum_dtype"] == "fp32"
    plain.dion3_momentum_dtype = "bfloat16"
    assert registry.config_to_kwargs(plain, [], None)["momentum_dtype"] == "bfloat16"
    config.dion3_momentum_dtype = torch.bfloat16  # agrees
    assert registry.config_to_kwargs(config, [], None)["momentum_dtype"] is torch.bfloat16
    with pytest.raises(AssertionError, match="only supported with adam"):
        _config(optimizer="sgd", **bf16)


@pytest.mark.parametrize(
    "given, line",
    [
        (
            dict(exp_avg_sq_dtype="bf16"),
            "exp_avg_sq_dtype must be fp32, got bf16: Dion3 keeps one variance per row of a matrix, in fp32 (a few bytes per row)",
        ),
        (dict(main_params_dtype="fp16"), "main_params_dtype must be fp32, got fp16: Dion3 steps fp32 main parameters"),
        (dict(main_grads_dtype="bf16"), "main_grads_dtype must be fp32, got bf16: Dion3 steps fp32 main gradients"),
        (dict(exp_avg_dtype="fp16"), "exp_avg_dtype must be fp32 or bf16 (the dtype of Dion3's momentum), got fp16"),
        (
            dict(exp_avg_dtype="bf16", use_precision_aware_optimizer=False),
            "exp_avg_dtype bf16 is the precision-aware optimizer's: add use_precision_aware_optimizer (or give dion3_momentum_dtype bf16)",
        ),
        (
            dict(exp_avg_dtype="bf16", dion3_momentum_dtype="fp32"),
            "dion3_momentum_dtype fp32 and exp_avg_dtype bf16 disagree (both set the dtype of Dion3's momentum): give one of them",
        ),
    ],
    ids=["exp-avg-sq", "main-params", "main-grads", "fp16-momentum", "without-precision-aware", "disagree"],
)
def test_what_dion3_cannot_take_of_the_precision_aware_optimizer_is_refused_in_one_line(given, line):
    """With the precision-aware optimizer (unless said otherwise), in an OptimizerConfig (naming
    the field, the dtypes as torch dtypes) and in Megatron-LM's args (the launcher and validate_args:
    naming the flag)."""
    given = {"use_precision_aware_optimizer": True, **given}
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    as_config = {k: names.get(v, v) if k.endswith("_dtype") else v for k, v in given.items() if k != "dion3_momentum_dtype"}
    with pytest.raises((ValueError, AssertionError)) as refused:
        config = _config(**as_config)  # (Megatron's own assertion refuses exp_avg_dtype without the precision-aware optimizer)
        config.dion3_momentum_dtype = given.get("dion3_momentum_dtype")
        registry.config_to_kwargs(config, [], None)
    if refused.type is ValueError:
        assert str(refused.value) == f"--optimizer dion3: {line}"
    with pytest.raises(SystemExit) as stopped:
        precision.precision_validation(lambda a: a)(megatron_args(**given))
    as_flags = re.sub(r"\b[a-z0-9]+(?:_[a-z0-9]+)+\b", lambda name: "--" + name[0].replace("_", "-"), line)
    assert str(stopped.value) == f"--optimizer dion3: {as_flags}"


def test_megatron_lm_args_carry_the_momentum_dtype_their_flags_give():
    """validate_args (as registration wraps it) sets dion3_momentum_dtype, which Megatron's argument
    dump shows and the optimizer config copies; the flags stay as given."""
    seen = {}

    def validate_args(a, defaults={}):  # noqa: B006 - Megatron's signature
        seen.update(vars(a))
        return a

    validate = registry.validation(validate_args)
    cases = [
        (dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", dion3_momentum_dtype=None), BF16),
        (dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", dion3_momentum_dtype="bfloat16"), "bfloat16"),
        (dict(use_precision_aware_optimizer=False, exp_avg_dtype="fp32", dion3_momentum_dtype=BF16), BF16),
        (dict(use_precision_aware_optimizer=True, exp_avg_dtype="fp32", dion3_momentum_dtype=None), "fp32"),
        (dict(use_precision_aware_optimizer=False, exp_avg_dtype="fp32", dion3_momentum_dtype=None), "fp32"),
    ]
    for given, momentum in cases:
        args = validate(megatron_args(**given))
        assert seen["dion3_momentum_dtype"] == momentum and args.dion3_momentum_dtype == momentum
        assert (args.use_precision_aware_optimizer, args.exp_avg_dtype) == (given["use_precision_aware_optimizer"], given["exp_avg_dtype"])


def test_the_momentum_dtype_flag_takes_the_dtypes_by_name():
    from dion3_megatron.megatron import arguments

    parser = arguments.add_dion3_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).dion3_momentum_dtype is None  # unset: --exp-avg-dtype may set it
    for name in ("fp32", "float32", "bf16", "bfloat16"):
        assert parser.parse_args(["--dion3-momentum-dtype", name]).dion3_momentum_dtype == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--dion3-momentum-dtype", "fp16"])
