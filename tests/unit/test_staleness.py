"""Staleness-aware row selection: rows that waited are favoured; state, checkpoints, bad input."""

import copy
import importlib.util

import pytest
import torch

from dion3_megatron import Dion3, options
from dion3_megatron.core import rule
from dion3_megatron.engine import Dion3Engine, MatrixShard, Sharding


def test_boost_and_ageing_follow_the_formula(generator):
    scores = torch.rand(2, 6, generator=generator)
    age = torch.randint(0, 9, (2, 6), generator=generator).float()
    boosted = rule.staleness_boost(scores, age, staleness=2.0, fraction=0.25)
    torch.testing.assert_close(boosted, scores * (1 + 0.5 * age))
    idx = torch.tensor([[1, 4], [0, 5]])
    expected = age + 1
    expected[0, [1, 4]] = 0
    expected[1, [0, 5]] = 0
    rule.age_rows(age, idx)
    torch.testing.assert_close(age, expected)


def _rows_applied(staleness: float, steps: int, generator) -> set[int]:
    """Rows of a 16 x 24 matrix whose weight moved, when rows 12-15 always have 10x smaller
    gradients than the rest: plain L1 selection never reaches them."""
    weight = torch.nn.Parameter(torch.randn(16, 24, generator=generator))
    start = weight.detach().clone()
    opt = Dion3([weight], lr=0.05, fraction=0.25, mu=0.6, weight_decay=0.0, staleness=staleness, ns_dtype=torch.float64)
    scale = torch.ones(16, 1)
    scale[12:] = 0.1
    for _ in range(steps):
        weight.grad = torch.randn(16, 24, generator=generator) * scale
        opt.step()
    return set(torch.nonzero((weight.detach() - start).abs().sum(1)).view(-1).tolist())


@pytest.mark.slow
def test_staleness_reaches_rows_that_plain_selection_starves(generator):
    assert not _rows_applied(0.0, 32, generator) & {12, 13, 14, 15}
    assert {12, 13, 14, 15} <= _rows_applied(1.0, 32, generator)


def test_staleness_does_nothing_at_fraction_one(generator):
    data = torch.randn(8, 12, generator=generator)
    grads = [torch.randn(8, 12, generator=generator) for _ in range(3)]
    out = []
    for staleness in (0.0, 3.0):
        p = torch.nn.Parameter(data.clone())
        opt = Dion3([p], fraction=1.0, staleness=staleness, ns_dtype=torch.float64)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out.append(p.detach())
    assert torch.equal(out[0], out[1])


@pytest.mark.slow
def test_row_ages_survive_a_checkpoint_bit_identically(generator):
    shapes = [(16, 24), (16, 24), (24, 16)]
    data = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(6)]

    def make():
        params = [torch.nn.Parameter(d.clone()) for d in data]
        return params, Dion3(params, lr=0.03, fraction=0.25, staleness=1.0, ns_dtype=torch.float32)

    def run(params, opt, steps):
        for gs in steps:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()

    straight, opt = make()
    run(straight, opt, grads)
    resumed, opt2 = make()
    run(resumed, opt2, grads[:3])
    saved = copy.deepcopy(opt2.state_dict())
    assert all(saved["state"][i]["row_age"].shape == (1, s[0]) for i, s in enumerate(shapes))
    assert (saved["state"][0]["row_age"] > 0).any()
    params, opt3 = make()
    for p, q in zip(params, resumed):
        p.data.copy_(q)
    opt3.load_state_dict(saved)
    run(params, opt3, grads[3:])
    for p, q in zip(params, straight):
        assert torch.equal(p, q)


def test_staleness_switched_on_later_starts_every_row_at_age_zero(generator):
    p = torch.nn.Parameter(torch.randn(8, 12, generator=generator))
    opt = Dion3([p], fraction=0.25, staleness=0.0, ns_dtype=torch.float32)
    p.grad = torch.randn(8, 12, generator=generator)
    opt.step()
    assert "row_age" not in opt.state[p]
    opt.param_groups[0]["staleness"] = 1.0
    p.grad = torch.randn(8, 12, generator=generator)
    opt.step()
    age = opt.state[p]["row_age"]
    assert sorted(age.view(-1).tolist()) == [0.0, 0.0] + [1.0] * 6


@pytest.mark.parametrize("value", [-1.0, float("inf"), True, "1"])
def test_bad_staleness_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"staleness must be a finite number >= 0, got"):
        Dion3([torch.nn.Parameter(torch.randn(4, 4))], staleness=value)


@pytest.mark.slow
def test_the_engine_steps_whole_matrices_with_staleness_like_the_optimizer(generator):
    shapes = [(16, 24)] * 3 + [(24, 16)]
    data = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(8)]
    hp = options.hyperparameters(fraction=0.25, staleness=1.0, ns_dtype=torch.float32)
    shards = [MatrixShard(f"m{j}", d.clone(), None, d.shape, Sharding.full(), None, hp) for j, d in enumerate(data)]
    engine = Dion3Engine(shards)
    params = [torch.nn.Parameter(d.clone()) for d in data]
    opt = Dion3(params, fraction=0.25, staleness=1.0, ns_dtype=torch.float32)
    for step_grads in grads:
        for shard, p, g in zip(shards, params, step_grads):
            shard.grad, p.grad = g, g.clone()
        engine.step()
        opt.step()
    for shard, p in zip(shards, params):
        torch.testing.assert_close(shard.weight, p.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(shard.state["row_age"], opt.state[p]["row_age"][0])


@pytest.mark.parametrize("built,changed", [(0.0, 1.0), (1.0, 0.5)])
def test_the_engine_refuses_a_staleness_changed_since_it_was_built(generator, built, changed):
    hp = options.hyperparameters(fraction=0.5, staleness=built)
    weight = torch.randn(8, 8, generator=generator)
    shard = MatrixShard("w", weight, torch.randn(8, 8, generator=generator), (8, 8), Sharding.full(), None, hp)
    engine = Dion3Engine([shard])
    shard.hp = options.hyperparameters(fraction=0.5, staleness=changed)
    before = weight.clone()
    with pytest.raises(ValueError, match=f"staleness changed from {built} to {changed} since the engine was built"):
        engine.step()
    assert torch.equal(weight, before)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (the deepspeed extra)")
def test_deepspeed_takes_staleness_and_refuses_bad_values_naming_them(generator):
    from dion3_megatron.deepspeed.optimizer import DeepSpeedDion3

    data = torch.randn(8, 12, generator=generator)
    grads = [torch.randn(8, 12, generator=generator) for _ in range(4)]
    weights = [torch.nn.Parameter(data.clone()) for _ in range(2)]
    opts = [
        DeepSpeedDion3([{"params": [weights[0]], "staleness": 1.0}], fraction=0.25),  # the JSON path
        Dion3([weights[1]], fraction=0.25, staleness=1.0),
    ]
    for g in grads:
        for w, opt in zip(weights, opts):
            w.grad = g.clone()
            opt.step()
    assert torch.equal(weights[0], weights[1])
    with pytest.raises(ValueError, match="param group 0: staleness must be a finite number >= 0, got -1.0"):
        DeepSpeedDion3([{"params": [weights[0]], "staleness": -1.0}])
