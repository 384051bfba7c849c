"""The Dion3 rule: NorMuon at fraction 1, row selection, error feedback, lr scaling."""

import dataclasses
import math

import pytest
import torch

from dion3_megatron import Dion3, options
from dion3_megatron.core import ortho
from dion3_megatron.core import rule


def normuon_reference(weights, grads_per_step, lr, mu, beta2, wd, eps):
    """Plain NorMuon with heavy-ball momentum, in fp64, one matrix at a time."""
    weights = [w.double().clone() for w in weights]
    buffers = [torch.zeros_like(w) for w in weights]
    variances = [torch.zeros(w.shape[0], dtype=torch.float64) for w in weights]
    coefficients = ortho.polar_express_coefficients(ortho.GRAM_SAFETY)
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            buffers[i] = mu * buffers[i] + g.double()
            if buffers[i].shape[0] == buffers[i].shape[1]:  # square matrices take standard NS's own schedule
                o = ortho.newton_schulz(buffers[i], dtype=torch.float64)
            else:
                o = ortho.newton_schulz(buffers[i], coefficients, dtype=torch.float64, norm_factor=1.0)
            variances[i] = beta2 * variances[i] + (1 - beta2) * (o**2).mean(dim=1)
            on = o / (variances[i].sqrt() + eps)[:, None]
            on = on * o.norm() / on.norm()
            n, m = weights[i].shape
            weights[i] = weights[i] * (1 - lr * wd) - lr * math.sqrt(n / m) * on
    return weights


def test_fraction_one_is_normuon_with_heavy_ball(generator):
    shapes = [(24, 64), (64, 24), (24, 64), (40, 40)]
    weights = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(4)]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Dion3(params, lr=0.05, fraction=1.0, mu=0.9, beta2=0.95, weight_decay=0.1, ns_dtype=torch.float64)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    expected = normuon_reference(weights, grads, 0.05, 0.9, 0.95, 0.1, 1e-8)
    for p, e in zip(params, expected):
        assert ((p.double() - e).norm() / e.norm()).item() <= 1e-6


def test_fraction_one_orthogonalizes_the_momentum_itself_then_decays_it(generator, monkeypatch):
    # no copy of the rows (take_selected is never asked); two groups of one shape with their own mu
    # are orthogonalized as one batch and each still follows NorMuon with its heavy ball
    def no_copy(*args, **kwargs):
        raise AssertionError("f = 1 copied the momentum's rows out")

    monkeypatch.setattr(rule, "take_selected", no_copy)
    shape, mus = (24, 64), (0.9, 0.5)
    weights = [torch.randn(shape, generator=generator) for _ in mus]
    grads = [[torch.randn(shape, generator=generator) for _ in mus] for _ in range(3)]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    groups = [dict(params=[p], mu=mu) for p, mu in zip(params, mus)]
    opt = Dion3(groups, lr=0.05, fraction=1.0, beta2=0.95, weight_decay=0.1, ns_dtype=torch.float64)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    for i, mu in enumerate(mus):
        (expected,) = normuon_reference([weights[i]], [[g[i]] for g in grads], 0.05, mu, 0.95, 0.1, 1e-8)
        assert ((params[i].double() - expected).norm() / expected.norm()).item() <= 1e-6


def test_only_selected_rows_move_and_the_rest_accumulate(generator):
    n, m, f, lr, wd, mu = 32, 48, 0.25, 0.1, 0.05, 0.9
    w0 = torch.randn(n, m, generator=generator)
    p = torch.nn.Parameter(w0.clone())
    opt = Dion3([p], lr=lr, fraction=f, mu=mu, weight_decay=wd, staleness=0.0)  # selection by L1 norm alone
    g1 = torch.randn(n, m, generator=generator)
    p.grad = g1.clone()
    opt.step()
    k = math.ceil(f * n)
    chosen = torch.topk(g1.abs().sum(1), k).indices
    mask = torch.zeros(n, dtype=torch.bool)
    mask[chosen] = True
    decayed = w0 * (1 - lr * rule.fraction_lr_multiplier(f, True) * wd)  # the default scales the decay too
    assert torch.equal(p[~mask].detach(), decayed[~mask])
    assert (p[mask].detach() - decayed[mask]).abs().amax(dim=1).min() > 1e-4
    momentum = opt.state[p]["momentum"]
    assert torch.equal(momentum[~mask], g1[~mask])
    assert torch.allclose(momentum[mask], mu * g1[mask])
    variance = opt.state[p]["variance"].view(-1)
    assert torch.all(variance[~mask] == 0) and torch.all(variance[mask] > 0)
    # Second step: unselected rows keep accumulating untouched.
    g2 = torch.randn(n, m, generator=generator)
    p.grad = g2.clone()
    before = momentum.clone()
    opt.step()
    chosen2 = torch.topk((before + g2).abs().sum(1), k).indices
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[chosen2] = False
    assert torch.equal(momentum[untouched], (before + g2)[untouched])


def _assert_first_step_decays_applied_rows_by(decay: float, f: float, generator, **settings) -> None:
    """One step of a fresh (32, 24) matrix: the applied rows' momentum is decay * g, the rest g."""
    n, m = 32, 24
    p = torch.nn.Parameter(torch.randn(n, m, generator=generator))
    opt = Dion3([p], fraction=f, **settings)
    g = torch.randn(n, m, generator=generator)
    p.grad = g.clone()
    opt.step()
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.topk(g.abs().sum(1), math.ceil(f * n)).indices] = True
    momentum = opt.state[p]["momentum"]
    assert torch.allclose(momentum[mask], decay * g[mask])
    assert torch.equal(momentum[~mask], g[~mask])


@pytest.mark.parametrize("f", [0.25, 0.125, 1.0])
def test_scale_mu_by_fraction_decays_applied_rows_by_mu_to_the_one_over_f(f, generator):
    mu = 0.9
    hp = options.hyperparameters(mu=mu, scale_mu_by_fraction=True)
    assert rule.momentum_decay(hp, f) == pytest.approx(mu ** (1 / f))
    assert rule.momentum_decay(options.hyperparameters(mu=mu), f) == mu
    _assert_first_step_decays_applied_rows_by(mu ** (1 / f), f, generator, mu=mu, scale_mu_by_fraction=True)


@pytest.mark.parametrize("f, expected", [(0.25, 0.6), (0.125, 0.36), (0.5, 0.6**0.5), (1.0, 0.6**0.25)])
def test_default_mu_keeps_the_memory_per_step_of_0_6_at_a_quarter(f, expected, generator):
    """mu unset: the applied rows keep 0.6 ** (1 / (4 f)); an explicit mu is kept as given at any f."""
    assert rule.momentum_decay(options.hyperparameters(), f) == pytest.approx(expected, rel=1e-12)
    assert rule.momentum_decay(options.hyperparameters(mu=0.6), f) == 0.6
    _assert_first_step_decays_applied_rows_by(expected, f, generator)
    _assert_first_step_decays_applied_rows_by(0.6, f, generator, mu=0.6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lrs", [[0.02, 0.03, 0.02], [0.02, 0.02, 0.02]])
def test_update_factors_as_tensors_equal_numbers(dtype, lrs, generator):
    """The tensor form (what a CUDA graph reads) updates weights and variances bit-identically."""
    batch, n, c, k = 3, 24, 16, 7
    weights = torch.randn(batch, n, c, generator=generator).to(dtype)
    variance = torch.rand(batch, n, generator=generator)
    idx = torch.stack([torch.randperm(n, generator=generator)[:k] for _ in range(batch)])
    ortho = torch.randn(batch, k, c, generator=generator)
    numbers = rule.UpdateFactors.of(lrs, [0.1, 0.0, 0.1], [1.5, 1.5, 2.0])
    tensors = rule.UpdateFactors(torch.tensor(numbers.shrink), torch.tensor(numbers.coef))
    results = []
    for factors in (numbers, tensors):
        w, v = weights.clone(), variance.clone()
        rule.normalize_and_apply(list(w.unbind(0)), v, idx, ortho, 0.95, 1e-8, factors)
        results.append((w, v))
    (w_num, v_num), (w_ten, v_ten) = results
    assert torch.equal(w_num, w_ten) and torch.equal(v_num, v_ten)
    assert not torch.equal(w_num, weights)


def test_per_head_selection_takes_k_rows_in_every_head(generator):
    heads, head_dim = 4, 8
    scores = torch.rand(2, heads * head_dim, generator=generator)
    scores[:, :head_dim] += 10  # head 0 dominates: a global top-k would take only its rows
    idx = rule.select_rows(scores, 0.25, num_heads=heads)
    assert idx.shape == (2, heads * 2)
    for b in range(2):
        per_head = (idx[b] // head_dim).bincount(minlength=heads)
        assert per_head.tolist() == [2] * heads
        for h in range(heads):
            block = scores[b, h * head_dim : (h + 1) * head_dim]
            expected = torch.topk(block, 2).indices + h * head_dim
            assert set(idx[b][idx[b] // head_dim == h].tolist()) == set(expected.tolist())
    global_idx = rule.select_rows(scores, 0.25)
    assert torch.all(global_idx < head_dim)


def test_accumulate_and_score_adds_the_gradients_and_scores_rows_by_l1(generator):
    momentum = torch.randn(3, 7, 11, generator=generator)
    before = momentum.clone()
    grads = [torch.randn(7, 11, generator=generator).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float32)]
    out = torch.full((3, 7), float("nan"))
    scores = rule.accumulate_and_score(momentum, grads, out=out)
    assert scores is out
    assert torch.equal(momentum, before + torch.stack([g.float() for g in grads]))
    assert torch.allclose(scores.double(), momentum.double().abs().sum(-1), rtol=1e-6, atol=0)


def test_a_folded_decay_leaves_the_momentum_decayed_and_scores_it_before(generator):
    momentum = torch.randn(2, 5, 9, generator=generator)
    grads = [torch.randn(5, 9, generator=generator) for _ in range(2)]
    summed = momentum + torch.stack(grads)
    scores = rule.accumulate_and_score(momentum, grads, decay=0.75)
    assert torch.equal(momentum, summed * 0.75)
    assert torch.allclose(scores.double(), summed.double().abs().sum(-1), rtol=1e-6, atol=0)


def test_the_decay_folds_only_into_a_step_that_selects_every_row():
    hp = options.hyperparameters(fraction=1.0, mu=0.9)
    assert rule.folded_decay(hp, 12) == 0.9
    assert rule.folded_decay(dataclasses.replace(hp, fraction=0.25), 12) is None  # some rows stay out
    assert rule.folded_decay(dataclasses.replace(hp, mu=0.0), 12) is None  # nothing left to orthogonalize
    assert rule.folded_decay(hp, 12, mu=torch.full((3,), 0.9)) is None  # one per matrix, on the device


def test_fraction_one_decays_the_momentum_in_the_accumulation_pass(generator, monkeypatch):
    """mu * (M + G) is orthogonalized, not M + G (the same up to rounding: orthogonalization does not
    see the scale), and no pass of its own decays the momentum; with mu = 0 it still does, after."""
    shape = (24, 64)
    for mu, passes in ((0.9, 0), (0.0, 2)):
        calls = []
        monkeypatch.setattr(rule, "decay_momentum", lambda m, factor, calls=calls: calls.append(factor) or m.mul_(factor))
        weight = torch.randn(shape, generator=generator)
        grads = [torch.randn(shape, generator=generator) for _ in range(2)]
        param = torch.nn.Parameter(weight.clone())
        opt = Dion3([param], lr=0.05, fraction=1.0, mu=mu, beta2=0.95, weight_decay=0.1, ns_dtype=torch.float64)
        for g in grads:
            param.grad = g.clone()
            opt.step()
        assert len(calls) == passes
        (expected,) = normuon_reference([weight], [[g] for g in grads], 0.05, mu, 0.95, 0.1, 1e-8)
        assert ((param.double() - expected).norm() / expected.norm()).item() <= 1e-6
        # fp32 sums of O(1) values: where they cancel, the rounding of the terms (~1e-7 each) is left
        assert torch.allclose(
            opt.state[param]["momentum"].double(),
            sum(mu ** (len(grads) - i) * g.double() for i, g in enumerate(grads)),
            rtol=1e-6,
            atol=1e-6,
        )


def test_ties_break_by_index():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0, 0.5, 3.0]])
    assert rule.select_rows(scores, 0.25).tolist() == [[1, 2]]
    assert rule.select_rows(torch.ones(3, 10), 0.3).tolist() == [[0, 1, 2]] * 3
    assert rule.select_rows(torch.zeros(1, 5), 0.01).tolist() == [[0]]  # k is at least 1


def test_selected_row_count():
    assert rule.selected_row_count(100, 0.25) == 25
    assert rule.selected_row_count(10, 0.125) == 2
    assert rule.selected_row_count(3, 0.01) == 1
    assert rule.selected_row_count(64, 0.125, num_heads=4) == 8
    assert rule.selected_row_count(64, 0.01, num_heads=4) == 4
    with pytest.raises(ValueError, match="num_heads"):
        rule.selected_row_count(10, 0.5, num_heads=3)


def test_update_scale_modes():
    assert rule.update_scale(64, 16) == pytest.approx(2.0)
    assert rule.update_scale(64, 16, "rms_norm") == pytest.approx(0.2 * 8)
    with pytest.raises(ValueError, match="adjust_lr"):
        rule.update_scale(4, 4, "max")


def test_fraction_lr_multiplier_grows_as_one_over_f_up_to_four():
    assert [rule.fraction_lr_multiplier(f, True) for f in (1.0, 0.5, 0.25, 0.125, 0.01)] == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert rule.fraction_lr_multiplier(0.125, False) == 1.0


@pytest.mark.parametrize("adjust_lr,scale_by_f", [("spectral_norm", False), ("rms_norm", False), ("spectral_norm", True)])
def test_step_norm_follows_the_scale(adjust_lr, scale_by_f, generator):
    n, m, f, lr = 48, 16, 0.25, 0.01
    p = torch.nn.Parameter(torch.randn(n, m, generator=generator))
    w0 = p.detach().clone()
    opt = Dion3([p], lr=lr, fraction=f, weight_decay=0.0, adjust_lr=adjust_lr, scale_lr_by_fraction=scale_by_f, ns_dtype=torch.float64)
    g = torch.randn(n, m, generator=generator)
    p.grad = g.clone()
    opt.step()
    k = rule.selected_row_count(n, f)
    rows = torch.sort(torch.topk(g.abs().sum(1), k).indices).values
    # NorMuon keeps the orthogonalized block's Frobenius norm, so the step's norm is lr*scale*||O||.
    ortho_norm = ortho.gram_newton_schulz(g[rows].double(), dtype=torch.float64).norm()
    expected = lr * rule.fraction_lr_multiplier(f, scale_by_f) * rule.update_scale(n, m, adjust_lr) * ortho_norm
    assert (p.detach() - w0).norm().item() == pytest.approx(expected.item(), rel=1e-5)


def test_adamw_path_matches_torch_adamw(generator):
    data = torch.randn(37, generator=generator)
    ours = torch.nn.Parameter(data.clone())
    ref = torch.nn.Parameter(data.clone())
    opt = Dion3([ours], adamw_lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(37, generator=generator)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


def test_half_precision_rows_go_on_as_they_are(generator, monkeypatch):
    """Newton-Schulz in bf16: the orthogonalized rows reach NorMuon and the weights as bf16, and the
    steps equal, bit for bit, the ones taken through an fp32 copy of them."""
    shapes = [(24, 64), (64, 24), (24, 64), (40, 40)]
    weights = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(3)]
    original = rule.orthogonalize_rows

    def run():
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = Dion3(params, fraction=0.5, ns_dtype=torch.bfloat16)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        return params, opt

    dtypes = []
    monkeypatch.setattr(rule, "orthogonalize_rows", lambda s, hp: dtypes.append(original(s, hp)) or dtypes[-1])
    half_params, half_opt = run()
    assert {t.dtype for t in dtypes} == {torch.bfloat16}
    monkeypatch.setattr(rule, "orthogonalize_rows", lambda s, hp: original(s, hp).float())
    full_params, full_opt = run()
    for half, full in zip(half_params, full_params):
        assert torch.equal(half, full)
        for key in ("momentum", "variance"):
            assert torch.equal(half_opt.state[half][key], full_opt.state[full][key])
