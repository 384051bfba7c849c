"""MegatronDion3 in one process (no torch.distributed): logical-matrix split, state layout, checkpoints."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from dion3_megatron import Dion3  # noqa: E402
from dion3_megatron.megatron import MegatronDion3, describe_param  # noqa: E402

GROUPS, SPLIT, COLS = 2, [4, 2, 2], 6  # 2 query groups of [q q q q k k v v] rows


def _params(generator):
    qkv = torch.nn.Parameter(torch.randn(GROUPS * sum(SPLIT), COLS, generator=generator))
    qkv.is_qkv, qkv.qkv_split_shapes = True, SPLIT
    fc1 = torch.nn.Parameter(torch.randn(10, COLS, generator=generator))
    proj = torch.nn.Parameter(torch.randn(COLS, 7, generator=generator))
    names = {
        qkv: "layers.0.self_attention.linear_qkv.weight",
        fc1: "layers.0.mlp.linear_fc1.weight",
        proj: "layers.0.self_attention.linear_proj.weight",
    }
    return [qkv, fc1, proj], names


def _split(name, t):
    if "linear_qkv" in name:
        return [p.reshape(-1, t.shape[1]) for p in torch.split(t.view(GROUPS, sum(SPLIT), -1), SPLIT, dim=1)]
    if "linear_fc1" in name:
        return list(t.chunk(2))
    return [t]


def _megatron(params, names, **kw):
    layouts = {p: describe_param(names[p], p, gated_linear_unit=True) for p in params}
    return MegatronDion3([{"params": params}], lr=0.05, weight_decay=0.1, fraction=0.5, layouts=layouts, **kw)


def _grads(generator, params, steps):
    return [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(steps)]


def _one_step(opt, params, generator):
    for p, g in zip(params, _grads(generator, params, 1)[0]):
        p.grad = g
    opt.step()


def _saved_state(opt) -> dict:
    """A copy of the optimizer's state as its state dict holds it."""
    return {i: {k: v.clone() for k, v in state.items()} for i, state in opt.state_dict()["state"].items()}


def _assert_state_is(opt, before: dict) -> None:
    for i, state in opt.state_dict()["state"].items():
        assert state.keys() == before[i].keys()
        for k, v in state.items():
            assert torch.equal(v, before[i][k]), (i, k)


def test_describe_param_finds_q_k_v_and_gate_up(generator):
    params, names = _params(generator)
    qkv = describe_param(names[params[0]], params[0])
    assert [(p.suffix, p.start, p.stop, p.full_shape) for p in qkv.matrices] == [
        ("q", 0, 8, (8, COLS)),
        ("k", 8, 12, (4, COLS)),
        ("v", 12, 16, (4, COLS)),
    ]
    # Working row i is local row perm[i]: Q of group 0, Q of group 1, K ..., V ...
    assert qkv.perm.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    fc1 = describe_param(names[params[1]], params[1], gated_linear_unit=True)
    assert [p.suffix for p in fc1.matrices] == ["gate", "up"] and fc1.perm is None
    assert [p.suffix for p in describe_param(names[params[1]], params[1]).matrices] == [""]  # not gated
    # TEGroupedMLP keeps one fc1 weight per local expert: weight0, weight1, ...
    expert_fc1 = describe_param("decoder.layers.0.mlp.experts.linear_fc1.weight3", params[1], gated_linear_unit=True)
    assert [(p.suffix, p.start, p.stop) for p in expert_fc1.matrices] == [("gate", 0, 5), ("up", 5, 10)]
    expert_fc2 = describe_param("decoder.layers.0.mlp.experts.linear_fc2.weight3", params[2], gated_linear_unit=True)
    assert [p.suffix for p in expert_fc2.matrices] == [""]


@pytest.mark.parametrize("groups,split,ranks", [(2, (4, 2, 2), 2), (3, (2, 1, 1), 5), (4, (4, 2, 2), 3), (1, (4, 2, 2), 7)])
def test_fsdp2_row_chunks_hold_each_logical_matrix_as_one_row_block(groups, split, ranks):
    """torch FSDP2's Shard(0) chunks of a fused QKV weight, even or not, cutting query groups or
    not, empty or not: on every rank the chunk's rows, in the piece's working order, are rows
    [bounds[r], bounds[r + 1]) of Q, K and V, and the ranks' blocks cover each matrix once."""
    from dion3_megatron.megatron.layout import data_parallel_piece

    rows = groups * sum(split)
    param = torch.randn(rows, 3)
    param.is_qkv, param.qkv_split_shapes = True, list(split)
    whole = describe_param("decoder.layers.0.self_attention.linear_qkv.weight", param)
    working = param[whole.perm]
    logical = [working[m.start : m.stop] for m in whole.matrices]
    for rank, chunk in enumerate(torch.chunk(param, ranks) + (param[:0],) * (ranks - len(torch.chunk(param, ranks)))):
        piece = data_parallel_piece(whole, rank, ranks, None)
        assert piece.local_shape == tuple(chunk.shape)
        local = chunk if piece.perm is None else chunk[piece.perm]
        for held, matrix, full in zip(piece.matrices, whole.matrices, logical):
            assert held.bounds[0] == 0 and held.bounds[-1] == matrix.stop - matrix.start and len(held.bounds) == ranks + 1
            assert torch.equal(local[held.start : held.stop], full[held.bounds[rank] : held.bounds[rank + 1]])


def _stepped_with_dion3(params, names, grads, switch_at=None):
    """(MegatronDion3, single-process Dion3 on the logical matrices (leaves)) stepped alike;
    staleness 1 from step ``switch_at`` on (None: never)."""
    leaves = {p: [t.clone() for t in _split(names[p], p.data)] for p in params}
    ref = Dion3([t for p in params for t in leaves[p]], lr=0.05, weight_decay=0.1, fraction=0.5, staleness=float(switch_at == 0))
    opt = _megatron(params, names, staleness=float(switch_at == 0))
    for step, step_grads in enumerate(grads):
        if step == switch_at:
            opt.param_groups[0]["staleness"] = ref.param_groups[0]["staleness"] = 1.0
        for p, g in zip(params, step_grads):
            p.grad = g
            for leaf, piece in zip(leaves[p], _split(names[p], g)):
                leaf.grad = piece.clone()
        opt.step()
        ref.step()
    return opt, ref, leaves


def test_steps_equal_single_process_dion3_on_logical_matrices(generator):
    params, names = _params(generator)
    initial = [p.data.clone() for p in params]
    _, _, leaves = _stepped_with_dion3(params, names, _grads(generator, params, 3))
    for p, start in zip(params, initial):
        for leaf, got in zip(leaves[p], _split(names[p], p.data)):
            torch.testing.assert_close(got, leaf, atol=1e-6, rtol=0)
        assert (p.data - start).abs().max() > 1e-2  # every matrix moved


@pytest.mark.parametrize("staleness", [0.0, 1.0])
def test_state_dict_is_param_shaped_and_resumes_identically(generator, staleness):
    params, names = _params(generator)
    grads = _grads(generator, params, 4)
    opt = _megatron(params, names, staleness=staleness)
    for step in range(2):
        for p, g in zip(params, grads[step]):
            p.grad = g
        opt.step()
    sd = opt.state_dict()
    per_row = ["variance", "row_age"] if staleness else ["variance"]
    for index, p in enumerate(params):
        assert {k: tuple(v.shape) for k, v in sd["state"][index].items()} == {key: tuple(p.shape) for key in ["momentum", *per_row]}
        for key in per_row:
            values = sd["state"][index][key]
            assert torch.equal(values, values[:, :1].expand_as(values))  # one value per row
            assert values.abs().max() > 0
    # QKV momentum comes back in the parameter's own (interleaved) row order.
    (m_q, m_k, m_v) = _split(names[params[0]], sd["state"][0]["momentum"])
    shards = opt._shards[params[0]]
    assert [s.name.rsplit(".", 1)[1] for s in shards] == ["q", "k", "v"]
    for got, shard in zip((m_q, m_k, m_v), shards):
        assert torch.equal(got, shard.state["momentum"])

    clones = _clones(params)
    resumed = _megatron(clones, {c: names[p] for c, p in zip(clones, params)}, staleness=staleness)
    resumed.load_state_dict(sd)
    for step in range(2, 4):
        for p, c, g in zip(params, clones, grads[step]):
            p.grad, c.grad = g, g.clone()
        opt.step()
        resumed.step()
    for p, c in zip(params, clones):
        assert torch.equal(p.data, c.data)


@pytest.mark.parametrize("switch_at", [0, 3], ids=["from-the-start", "switched-on-at-step-3"])
def test_staleness_equals_single_process_dion3_and_can_be_switched_on_later(generator, switch_at):
    params, names = _params(generator)
    clones = _clones(params)
    grads = _grads(generator, params, 7)
    opt, ref, leaves = _stepped_with_dion3(params, names, grads, switch_at)
    saved = opt.state_dict()["state"]
    for index, p in enumerate(params):  # the ages (in the parameter's own row order, QKV interleaved), the weights
        ages = saved[index]["row_age"][:, 0]
        for leaf, got, age in zip(leaves[p], _split(names[p], p.data), _split(names[p], ages[:, None])):
            torch.testing.assert_close(got, leaf, atol=1e-6, rtol=0)
            assert torch.equal(age[:, 0], ref.state[leaf]["row_age"][0])
    _stepped_with_dion3(clones, {c: names[p] for c, p in zip(clones, params)}, grads)
    assert max((p.data - c.data).abs().max() for p, c in zip(params, clones)) > 1e-3  # the ages mattered


def _clones(params):
    """Fresh parameters with the same values and Megatron marks (is_qkv, ...)."""
    clones = [torch.nn.Parameter(p.data.clone()) for p in params]
    for c, p in zip(clones, params):
        c.__dict__.update(p.__dict__)
    return clones


def test_load_state_dict_rejects_foreign_state(generator):
    params, names = _params(generator)
    opt = _megatron(params, names)
    sd = opt.state_dict()
    sd["state"][1]["momentum"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="not Dion3 state of this parameter"):
        opt.load_state_dict(sd)
    with pytest.raises(ValueError, match="ns_method must be one of"):
        _megatron(params, names, ns_method="nearby")


@pytest.mark.parametrize("key, value", [("fraction", 5), ("lr", float("inf")), ("scale_lr_by_fraction", "false")])
def test_load_state_dict_rejects_bad_group_settings_before_anything_changes(key, value, generator):
    params, names = _params(generator)
    opt = _megatron(params, names)
    _one_step(opt, params, generator)
    before = _saved_state(opt)
    sd = opt.state_dict()
    sd["param_groups"][0][key] = value
    sd["state"][0]["momentum"] = torch.zeros_like(sd["state"][0]["momentum"])
    sd["param_groups"][0]["fractions"] = {s.name: 0.25 for shards in opt._shards.values() for s in shards}
    with pytest.raises(ValueError, match=f"param group 0: {key} must be .*, got {value!r}"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0][key] != value
    _assert_state_is(opt, before)


def test_non_finite_gradient_skips_the_step(generator):
    params, names = _params(generator)
    opt = _megatron(params, names)
    for p, g in zip(params, _grads(generator, params, 1)[0]):
        p.grad = g
    opt.step()
    before_weights = [p.data.clone() for p in params]
    before_state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    for p, g in zip(params, _grads(generator, params, 1)[0]):
        p.grad = g
    params[1].grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite gradient, step skipped"):
        opt.step()
    assert opt.skipped_steps == 1
    for p, w in zip(params, before_weights):
        assert torch.equal(p.data, w)
    for key, value in opt.state_dict()["state"][0].items():
        assert torch.equal(value, before_state[key]), key


@pytest.mark.parametrize("change", ["setting", "sparse gradient"])
def test_a_step_the_checks_refuse_raises_by_name_before_anything_changes(generator, change):
    """The step's checks run at every step, not only when the engine is built."""
    params, names = _params(generator)
    opt = _megatron(params, names)
    _one_step(opt, params, generator)
    before, weights = _saved_state(opt), [p.detach().clone() for p in params]
    for p, g in zip(params, _grads(generator, params, 1)[0]):
        p.grad = g
    if change == "setting":
        opt.param_groups[0]["mu"] = 1.5
        message = r"param group 0: mu must be in \[0, 1\), got 1.5"
    else:
        params[2].grad = params[2].grad.to_sparse()
        message = rf"param group 0: {names[params[2]]}: Dion3 does not support sparse gradients"
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(params, weights)) and opt.skipped_steps == 0
    _assert_state_is(opt, before)


def test_auto_fraction_choices_survive_a_resume_on_a_machine_of_another_speed(monkeypatch, generator):
    from dion3_megatron.core import cost_model
    from dion3_megatron.engine import fractions

    flop_bound, launch_bound = cost_model.DeviceSpeed(1e6, 0.0, 1e30, 1e30), cost_model.DeviceSpeed(1e30, 1.0, 1e30, 1e30)
    shapes = {"layers.0.mlp.linear_fc2.weight": (512, 64), "layers.0.self_attention.linear_proj.weight": (1024, 32)}
    weights = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    grads = [{name: torch.randn(shape, generator=generator) for name, shape in shapes.items()} for _ in range(4)]

    def build(initial):
        params = {name: torch.nn.Parameter(w.clone()) for name, w in initial.items()}
        layouts = {p: describe_param(name, p) for name, p in params.items()}
        return params, MegatronDion3([{"params": list(params.values())}], lr=0.05, fraction="auto", layouts=layouts)

    def run(params, opt, steps):
        for step_grads in steps:
            for name, p in params.items():
                p.grad = step_grads[name].clone()
            opt.step()

    monkeypatch.setattr(cost_model, "TOKENS_PER_STEP", 0)  # the step is the whole iteration
    monkeypatch.setattr(fractions, "measure", lambda device, dtype: flop_bound)
    params, opt = build(weights)
    run(params, opt, grads[:2])
    saved, saved_weights = opt.state_dict(), {name: p.detach().clone() for name, p in params.items()}
    run(params, opt, grads[2:])
    monkeypatch.setattr(fractions, "measure", lambda device, dtype: launch_bound)  # would choose f = 1
    resumed, other = build(saved_weights)
    other.load_state_dict(saved)
    run(resumed, other, grads[2:])
    for name, p in params.items():
        assert torch.equal(p, resumed[name]), name
    assert saved["param_groups"][0]["fractions"] == {
        "layers.0.mlp.linear_fc2.weight": 0.25,
        "layers.0.self_attention.linear_proj.weight": 0.125,
    }
    assert other.state_dict()["param_groups"][0]["fractions"] == saved["param_groups"][0]["fractions"]
    assert set(saved) == {"state", "param_groups", "skipped_steps"}  # the record is the groups' alone
    bad = dict(saved, param_groups=[{**saved["param_groups"][0], "fractions": {"layers.0.mlp.linear_fc2.weight": 0.3}}])
    with pytest.raises(ValueError, match="param group 0: 'layers.0.mlp.linear_fc2.weight' has fraction 0.3"):
        other.load_state_dict(bad)


@pytest.mark.parametrize("case", ["ages-missing", "ages-at-staleness-0"])
def test_load_state_dict_refuses_row_ages_that_do_not_match_the_staleness(generator, case):
    params, names = _params(generator)
    opt = _megatron(params, names, staleness=1.0)
    _one_step(opt, params, generator)
    before = _saved_state(opt)
    sd = opt.state_dict()
    if case == "ages-missing":  # a checkpoint stepped with staleness keeps every parameter's ages
        del sd["state"][1]["row_age"]
        words = r"param group 0, param 1 .*staleness=1.0 \(expected \['momentum', 'variance', 'row_age'\]"
    else:  # ages, but the groups (which the load takes) say staleness 0
        sd["param_groups"][0]["staleness"] = 0.0
        words = r"param group 0, param 0 .*staleness=0.0 \(expected \['momentum', 'variance'\]"
    for state in sd["state"].values():
        state["momentum"] = torch.zeros_like(state["momentum"])
    with pytest.raises(ValueError, match=words):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["staleness"] == 1.0
    _assert_state_is(opt, before)


@pytest.mark.parametrize("fraction", [0.5, "auto"])
def test_fractions_of_names_each_logical_matrix_with_the_f_its_steps_use(generator, fraction):
    from dion3_megatron.core.cost_model import CANDIDATE_FRACTIONS

    params, names = _params(generator)
    opt = _megatron(params, names)
    opt.param_groups[0]["fraction"] = fraction
    assert opt.fractions_of(params[0]) == []  # no engine before the first step
    _one_step(opt, params, generator)
    qkv, fc1, proj = (opt.fractions_of(p) for p in params)
    assert [shape for shape, _ in qkv] == [(GROUPS * s, COLS) for s in SPLIT]  # Q, K and V apart
    assert fc1 == [((5, COLS), fc1[0][1]), ((5, COLS), fc1[1][1])]  # SwiGLU gate and up halves
    assert [shape for shape, _ in proj] == [(COLS, 7)]
    for _, f in qkv + fc1 + proj:
        assert f == 0.5 if fraction == 0.5 else f in CANDIDATE_FRACTIONS


def test_auto_weighs_the_share_of_the_model_s_matrices_this_rank_steps(monkeypatch, generator):
    """Under the layer-wise ZeRO-1 a rank steps some of the model's matrices: fraction="auto" is told
    which share of them (by elements; embeddings and the output layer, Adam's, not counted)."""
    from dion3_megatron.core import cost_model

    model = torch.nn.Module()
    model.fc1 = torch.nn.Parameter(torch.randn(64, 32, generator=generator))
    model.fc2 = torch.nn.Parameter(torch.randn(32, 64, generator=generator))
    model.proj = torch.nn.Parameter(torch.randn(32, 32, generator=generator))
    model.embedding = torch.nn.Parameter(torch.randn(100, 32, generator=generator))
    model.embedding.is_embedding_or_output_parameter = True
    shares = []
    choose = cost_model.choose_fraction
    monkeypatch.setattr(
        cost_model, "choose_fraction", lambda *a, **kw: shares.append(a[7] if len(a) > 7 else kw.get("step_share", 1.0)) or choose(*a, **kw)
    )
    opt = MegatronDion3([{"params": [model.fc1, model.proj]}], lr=0.02, fraction="auto", model_chunks=[model])
    for p in (model.fc1, model.proj):
        p.grad = torch.randn(p.shape, generator=generator)
    opt.step()
    assert shares and set(shares) == {(64 * 32 + 32 * 32) / (64 * 32 + 32 * 64 + 32 * 32)}


def test_step_returns_the_closure_s_loss(generator):
    params, names = _params(generator)
    opt = _megatron(params, names)
    for p, g in zip(params, _grads(generator, params, 1)[0]):
        p.grad = g
    assert opt.step(lambda: 1.5) == 1.5
