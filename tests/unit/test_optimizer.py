"""Dion3 as a torch.optim.Optimizer: batching, tensor layouts, checkpoints, bad input."""

import copy
import importlib.util
import io
import warnings

import pytest
import torch

from dion3_megatron import Dion3, frontend, options
from dion3_megatron.core import rule

NEEDS_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core (the megatron extra)")
if importlib.util.find_spec("megatron") is not None:  # imported at collection: its first import takes seconds
    import dion3_megatron.megatron  # noqa: F401


def step_with(params, grads, **kwargs):
    opt = Dion3(params, **kwargs)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    return opt


def test_same_shape_matrices_are_orthogonalized_as_one_batch(generator, monkeypatch):
    shapes = [(16, 32)] * 3 + [(32, 16)] * 2 + [(20, 20)]
    data = [torch.randn(s, generator=generator) for s in shapes]
    grads = [torch.randn(s, generator=generator) for s in shapes]
    calls = []
    original = rule.orthogonalize_rows
    monkeypatch.setattr(rule, "orthogonalize_rows", lambda x, hp: calls.append(tuple(x.shape)) or original(x, hp))
    together = [torch.nn.Parameter(d.clone()) for d in data]
    step_with(together, grads, fraction=0.5, ns_dtype=torch.float64)
    # Selected blocks: 8x32 (x3), 16x16 (x2), 10x20 (x1): one call per distinct block shape.
    assert sorted(calls) == sorted([(3, 8, 32), (2, 16, 16), (1, 10, 20)])
    monkeypatch.setattr(rule, "orthogonalize_rows", original)
    for d, g, p in zip(data, grads, together):
        alone = torch.nn.Parameter(d.clone())
        step_with([alone], [g], fraction=0.5, ns_dtype=torch.float64)
        torch.testing.assert_close(p, alone, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_same_shape_state_shares_one_buffer_and_survives_changing_members(generator):
    shapes = [(12, 20), (12, 20), (3, 12, 20), (20, 12)]
    weights = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(4)]
    has_grad = [[True] * 4, [True, False, True, True], [False, True, True, False], [True] * 4]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Dion3(params, lr=0.02, fraction=0.5, ns_dtype=torch.float32)
    alone = [torch.nn.Parameter(w.clone()) for w in weights]  # one optimizer each: no shared buffer
    alone_opts = [Dion3([p], lr=0.02, fraction=0.5, ns_dtype=torch.float32) for p in alone]
    for step in range(4):
        for j in range(len(shapes)):
            params[j].grad = grads[step][j].clone() if has_grad[step][j] else None
            if has_grad[step][j]:
                alone[j].grad = grads[step][j].clone()
                alone_opts[j].step()
        opt.step()
    for p, q in zip(params, alone):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    momenta = [opt.state[p]["momentum"] for p in params[:3]]
    assert len({m.untyped_storage().data_ptr() for m in momenta}) == 1  # one buffer for the 12x20 matrices
    assert [tuple(m.shape) for m in momenta] == [(12, 20), (12, 20), (3, 12, 20)]


def test_3d_tensor_is_a_batch_of_matrices(generator):
    experts = torch.randn(4, 12, 20, generator=generator)
    grad = torch.randn(4, 12, 20, generator=generator)
    p = torch.nn.Parameter(experts.clone())
    opt = step_with([p], [grad], fraction=0.25, ns_dtype=torch.float64)
    assert opt.state[p]["variance"].shape == (4, 12)
    for e in range(4):
        alone = torch.nn.Parameter(experts[e].clone())
        step_with([alone], [grad[e]], fraction=0.25, ns_dtype=torch.float64)
        torch.testing.assert_close(p[e], alone, rtol=1e-6, atol=1e-7)


def test_conv_weight_flattens_to_a_matrix(generator):
    conv = torch.randn(8, 3, 3, 3, generator=generator)
    grad = torch.randn(8, 3, 3, 3, generator=generator)
    p = torch.nn.Parameter(conv.clone())
    step_with([p], [grad], fraction=0.5, ns_dtype=torch.float64)
    flat = torch.nn.Parameter(conv.reshape(8, 27).clone())
    step_with([flat], [grad.reshape(8, 27)], fraction=0.5, ns_dtype=torch.float64)
    torch.testing.assert_close(p.reshape(8, 27), flat, rtol=1e-6, atol=1e-7)


def test_any_memory_format_or_strided_gradient_steps_like_contiguous_tensors(generator):
    # A channels_last conv weight (and gradient), a transposed weight, a strided gradient of a
    # contiguous weight, and a bias on AdamW: the same steps as contiguous copies, bit for bit.
    conv = torch.randn(8, 3, 3, 3, generator=generator)
    transposed = torch.randn(16, 12, generator=generator)
    plain = torch.randn(12, 16, generator=generator)
    bias = torch.randn(8, generator=generator)
    grads = [
        [
            torch.randn(8, 3, 3, 3, generator=generator),
            torch.randn(16, 12, generator=generator),
            torch.randn(16, 12, generator=generator),
            torch.randn(8, generator=generator),
        ]
        for _ in range(3)
    ]
    strided = [
        torch.nn.Parameter(conv.clone().to(memory_format=torch.channels_last)),
        torch.nn.Parameter(transposed.clone().t()),
        torch.nn.Parameter(plain.clone()),
        torch.nn.Parameter(bias.clone()),
    ]
    dense = [torch.nn.Parameter(t.clone().contiguous()) for t in (conv, transposed.t(), plain, bias)]
    assert not strided[0].is_contiguous() and not strided[1].is_contiguous()
    runs = [
        (strided, Dion3(strided, lr=0.02, fraction=0.5, ns_dtype=torch.float32)),
        (dense, Dion3(dense, lr=0.02, fraction=0.5, ns_dtype=torch.float32)),
    ]
    for step_grads in grads:
        (c, t, p, b) = step_grads
        strided_grads = [c.to(memory_format=torch.channels_last), t.t(), t.t(), b]
        for (params, opt), grads_now in zip(runs, (strided_grads, [g.contiguous() for g in strided_grads])):
            for param, g in zip(params, grads_now):
                param.grad = g.clone(memory_format=torch.preserve_format)
            opt.step()
    assert strided[0].is_contiguous(memory_format=torch.channels_last)  # updated in place, layout kept
    for a, b in zip(strided, dense):
        assert torch.equal(a, b)
    assert all((a - t0).abs().max() > 1e-3 for a, t0 in zip(strided, (conv, transposed.t(), plain, bias)))


def test_a_step_that_raises_changes_no_weight_counter_or_state(generator):
    model, opt = make_model_and_optimizer()
    train(model, opt, random_batches(generator, 1))
    opt.param_groups.reverse()  # AdamW's group first: it used to step before the Dion3 group raised
    opt.param_groups[1]["num_heads"] = 5  # set after construction; 5 divides no matrix's rows here
    before = snapshot(model, opt)
    tokens, targets = random_batches(generator, 1)[0]
    torch.nn.functional.cross_entropy(model(tokens), targets).backward()
    with pytest.raises(ValueError, match="param group 1: num_heads=5 does not divide the 48 rows of param 0"):
        opt.step()
    assert_unchanged(model, opt, before)


def test_lrs_default_per_algorithm_and_a_groups_own_lr_wins():
    """The matrices take lr (default 0.01), the AdamW tensors adamw_lr (default 0.002): the < 2-D
    tensors of a plain list and AdamW groups without an lr, also ones added later; a group that
    mixes both keeps one lr (schedulers scale group["lr"] alone)."""
    matrix, bias, embed = (torch.nn.Parameter(torch.randn(*s)) for s in ((4, 4), (4,), (8, 4)))
    opt = Dion3([matrix, bias])
    assert [(g["lr"], [p is matrix for p in g["params"]]) for g in opt.param_groups] == [(0.01, [True]), (0.002, [False])]
    opt = Dion3(
        [{"params": [matrix], "algorithm": "dion3"}, {"params": [bias], "algorithm": "adamw", "lr": 0.001}], lr=0.03, adamw_lr=0.004
    )
    opt.add_param_group({"params": [embed], "algorithm": "adamw"})
    assert [g["lr"] for g in opt.param_groups] == [0.03, 0.001, 0.004]
    mixed = Dion3([{"params": [matrix, bias]}], lr=0.03)
    assert [g["lr"] for g in mixed.param_groups] == [0.03]
    # A one-group checkpoint does not load into the two groups a plain list makes.
    for p in (matrix, bias):
        p.grad = torch.randn_like(p)
    mixed.step()
    with pytest.raises(ValueError, match=r"checkpoint has 1 param groups, the optimizer has 2$"):
        Dion3([matrix, bias]).load_state_dict(mixed.state_dict())
    Dion3([{"params": [matrix, bias]}]).load_state_dict(mixed.state_dict())


def test_a_model_without_matrices_warns_once_that_every_parameter_takes_adamw():
    norm = torch.nn.LayerNorm(8)
    with pytest.warns(UserWarning) as record:
        Dion3(norm.parameters())
    assert [str(w.message) for w in record] == [
        "Dion3: none of the 2 parameters is a matrix for Dion3 (a tensor of >= 2 dims outside algorithm='adamw' "
        "groups): every parameter will take AdamW"
    ]
    with pytest.warns(UserWarning, match="none of the 1 parameters .* every parameter will take AdamW"):
        Dion3([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "algorithm": "adamw"}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Dion3(torch.nn.Linear(4, 4).parameters())  # a matrix: no warning


def test_fraction_and_algorithm_per_group(generator):
    a = torch.nn.Parameter(torch.randn(16, 8, generator=generator))
    b = torch.nn.Parameter(torch.randn(16, 8, generator=generator))
    c = torch.nn.Parameter(torch.randn(16, 8, generator=generator))
    opt = Dion3(
        [{"params": [a], "fraction": 0.25}, {"params": [b], "fraction": 0.5}, {"params": [c], "algorithm": "adamw"}],
        weight_decay=0.0,
    )
    before = [t.detach().clone() for t in (a, b, c)]
    for t in (a, b, c):
        t.grad = torch.randn(16, 8, generator=generator)
    opt.step()
    moved = [int(((t.detach() - t0).abs().sum(1) > 0).sum()) for t, t0 in zip((a, b, c), before)]
    assert moved == [4, 8, 16]
    assert set(opt.state[c]) == {"step", "exp_avg", "exp_avg_sq"}


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.up = torch.nn.Linear(16, 48)
        self.experts = torch.nn.Parameter(torch.randn(2, 16, 48) * 0.1)
        self.down = torch.nn.Linear(48, 32)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = torch.relu(self.up(h)) + torch.einsum("bd,edf->bf", h, self.experts)
        return self.down(h)


def make_model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = TinyModel()
    matrices = [model.up.weight, model.experts, model.down.weight]
    others = [model.embed.weight, model.up.bias, model.down.bias]
    opt = Dion3([{"params": matrices}, {"params": others, "algorithm": "adamw", "lr": 3e-3}], lr=0.02, fraction=0.25)
    return model, opt


def snapshot(model, opt) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_unchanged(model, opt, before: tuple[dict, dict]) -> None:
    """No weight, no optimizer state tensor (counters included) and no group setting differs from ``before``."""
    weights, state = before
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"]
    for pid, s in state["state"].items():
        for key, value in s.items():
            assert torch.equal(value, after["state"][pid][key]), (pid, key)


def train(model, opt, batches):
    losses = []
    for tokens, targets in batches:
        loss = torch.nn.functional.cross_entropy(model(tokens), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def random_batches(generator, count):
    return [(torch.randint(0, 32, (64,), generator=generator), torch.randint(0, 32, (64,), generator=generator)) for _ in range(count)]


@pytest.mark.slow
def test_state_dict_round_trip_continues_bit_identically(generator):
    model, opt = make_model_and_optimizer()
    batches = random_batches(generator, 6)
    train(model, opt, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    train(model, opt, batches[3:])

    resumed, resumed_opt = make_model_and_optimizer(seed=1)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    train(resumed, resumed_opt, batches[3:])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_state_stays_fp32_for_bf16_params(generator):
    p = torch.nn.Parameter(torch.randn(8, 16, generator=generator).bfloat16())
    opt = step_with([p], [torch.randn(8, 16, generator=generator).bfloat16()])
    fresh = Dion3([p])
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert fresh.state[p]["momentum"].dtype == torch.float32
    assert torch.equal(fresh.state[p]["momentum"], opt.state[p]["momentum"])


def test_zero_grad_frees_the_gradients_the_step_read(generator):
    """After the step the optimizer holds no gradient: ``zero_grad()`` frees them all, so the next
    backward does not find the last step's gradients still in memory."""
    import weakref

    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((8, 16), (8, 16), (3, 8, 4), (16,))]
    opt = Dion3(params, fraction=0.5)
    for _ in range(2):  # the first step builds the engine, the second reuses it
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        opt.step()
        grads = [weakref.ref(p.grad) for p in params]
        opt.zero_grad()
        assert [g() is None for g in grads] == [True] * len(params)


def test_mismatched_checkpoint_is_refused_whole(generator):
    model, opt = make_model_and_optimizer()
    train(model, opt, random_batches(generator, 1))
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][1]["momentum"] = torch.zeros(2, 16, 47)
    other_model, other = make_model_and_optimizer()
    train(other_model, other, random_batches(generator, 1))
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(sd)
    after = other.state_dict()
    for pid, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(value, after["state"][pid][key])
    with pytest.raises(ValueError, match="param groups"):
        Dion3([torch.nn.Parameter(torch.randn(4, 4))]).load_state_dict(sd)


@pytest.mark.slow
def test_dion3_lowers_the_loss_of_a_small_model(generator):
    model, opt = make_model_and_optimizer()
    tokens = torch.randint(0, 32, (256,), generator=generator)
    targets = (tokens * 7 + 3) % 32  # a learnable mapping
    losses = train(model, opt, [(tokens, targets)] * 60)
    assert losses[-1] < 0.5 * losses[0], losses[::10]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fraction=0.0), "fraction"),
        (dict(fraction=1.5), "fraction"),
        (dict(lr=-0.1), "lr"),
        (dict(mu=1.0), "mu"),
        (dict(mu=-0.5), "mu"),
        (dict(beta2=1.0), "beta2"),
        (dict(adjust_lr="spectral"), "adjust_lr"),
        (dict(ns_method="svd"), "ns_method"),
        (dict(betas=(0.9, 1.2)), "betas"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(lr=float("inf")), "lr must be a finite number >= 0, or a 0-d floating tensor holding one, got inf"),
        (dict(lr=float("nan")), "lr must be a finite number >= 0, or a 0-d floating tensor holding one, got nan"),
        (dict(weight_decay=float("inf")), "weight_decay must be a finite number >= 0, got inf"),
        (dict(eps=float("inf")), "eps must be a finite number > 0, got inf"),
        (dict(fraction=True), "fraction must be in \\(0, 1\\] or 'auto', got True"),
        (dict(mu=False), "mu must be in \\[0, 1\\), got False"),
        (dict(num_heads=True), "num_heads must be None or a positive int, got True"),
        (dict(num_heads=3), "num_heads=3 does not divide the 4 rows of param 0 \\(shape \\(4, 4\\)\\)"),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs, match):
    """A bad keyword argument is refused where it is given (the constructor, "Dion3: ..."); a setting
    that does not fit a parameter, by the group that gives it to the parameter."""
    where = "param group 0" if match.startswith("num_heads=") else "Dion3"
    with pytest.raises(ValueError, match=f"{where}: {match}"):
        Dion3([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_bad_groups_are_refused():
    w = torch.nn.Parameter(torch.randn(4, 4))
    b = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="param group 1: algorithm must be"):
        Dion3([{"params": [w]}, {"params": [b], "algorithm": "sgd"}])
    with pytest.raises(ValueError, match="param group 0: algorithm 'dion3' needs tensors with >= 2 dims"):
        Dion3([{"params": [b], "algorithm": "dion3"}])
    with pytest.raises(ValueError, match="param group 1: fraction"):
        Dion3([{"params": [w]}, {"params": [b], "fraction": 2}])


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("fraction", 5, "param group 0: fraction must be in \\(0, 1\\] or 'auto', got 5"),
        ("algorithm", "bogus", "param group 1: algorithm must be one of \\('dion3', 'adamw'\\) or absent, got 'bogus'"),
        ("lr", float("inf"), "param group 1: lr must be a finite number >= 0, or a 0-d floating tensor holding one, got inf"),
        ("betas", (0.9, 1.5), "param group 1: betas must be two values in \\[0, 1\\), got \\(0.9, 1.5\\)"),
        ("num_heads", 5, "param group 0: num_heads=5 does not divide the 48 rows of param 0"),
    ],
)
def test_checkpoint_with_bad_group_settings_is_refused_before_anything_changes(key, value, match, generator):
    model, opt = make_model_and_optimizer()
    train(model, opt, random_batches(generator, 1))
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0 if key in ("fraction", "num_heads") else 1][key] = value
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_unchanged(model, opt, before)


def test_sparse_gradient_is_refused():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = Dion3(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="param group 0: Dion3 does not support sparse gradients"):
        opt.step()


def check_gradients_usable(device, generator):
    """gradients_usable flags exactly the tensors holding NaN, +-inf or a magnitude >= 2**64 (whose
    square overflows fp32), in any dtype, at any position."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensors = [torch.randn(n, generator=generator).to(device=device, dtype=dtype) for n in (3, 5000, 70001)]
        largest = min(torch.finfo(dtype).max, 2.0**63)  # the largest magnitude tried that a step takes
        tensors.append(torch.full((7,), -largest, device=device, dtype=dtype))
        assert bool(frontend.gradients_usable(tensors))
        bad_values = [float("nan"), float("inf"), float("-inf")]
        if torch.finfo(dtype).max >= 2.0**64:
            bad_values += [2.0**64, -torch.finfo(dtype).max]
        for bad in bad_values:
            for t in tensors:
                where = int(torch.randint(t.numel(), (), generator=generator))
                kept = t[where].clone()
                t[where] = bad
                assert not bool(frontend.gradients_usable(tensors)), (dtype, bad, t.numel(), where)
                t[where] = kept
    assert bool(frontend.gradients_usable([torch.empty(0, device=device)]))


def test_gradients_usable(generator):
    check_gradients_usable(torch.device("cpu"), generator)


def test_huge_finite_gradients_step_like_unit_ones(generator):
    # Dion3's step is scale-invariant in the gradient: 1e18 x G must move the matrices as G does
    # (the selected block's Frobenius norm, ~1e20, overflowed fp32 and the update was silently zero).
    shapes = [(64, 96), (2, 48, 64)]
    weights = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(3)]
    runs = []
    for scale in (1.0, 1e18):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = Dion3(params, lr=0.02, fraction=0.25, ns_dtype=torch.float32)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g * scale
            opt.step()
        assert opt.skipped_steps == 0
        runs.append(params)
    for unit, huge, w in zip(*runs, weights):
        torch.testing.assert_close(huge, unit, rtol=0, atol=1e-5)
        assert (unit - w).abs().max() > 1e-3


@pytest.mark.parametrize("huge", [2.0**64, 2e38, -3.4e38])
def test_a_gradient_whose_square_overflows_skips_the_step(huge, generator):
    # From 2**64 a gradient's square overflows fp32 (AdamW's second moment, Megatron's grad norm);
    # at 2e38 the momentum overflowed and every weight became NaN.
    model, opt = make_model_and_optimizer()
    batches = random_batches(generator, 3)
    train(model, opt, batches[:1])
    for _ in range(2):  # twice: a second huge gradient would push the momentum past fp32's range
        before = snapshot(model, opt)
        tokens, targets = batches[1]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens), targets).backward()
        model.up.weight.grad.view(-1)[5] = huge
        with pytest.warns(RuntimeWarning, match="non-finite gradient, step skipped"):
            opt.step()
        assert_unchanged(model, opt, before)
    assert opt.skipped_steps == 2
    train(model, opt, batches[2:])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("bad_value", [float("inf"), float("nan")])
@pytest.mark.parametrize("where", ["matrix", "bias"])
def test_non_finite_gradient_skips_the_whole_step(bad_value, where, generator):
    model, opt = make_model_and_optimizer()
    train(model, opt, random_batches(generator, 2))
    before = snapshot(model, opt)
    tokens, targets = random_batches(generator, 1)[0]
    torch.nn.functional.cross_entropy(model(tokens), targets).backward()
    (model.up.weight if where == "matrix" else model.down.bias).grad.view(-1)[3] = bad_value
    with pytest.warns(RuntimeWarning, match="non-finite gradient, step skipped"):
        opt.step()
    assert opt.skipped_steps == 1
    assert_unchanged(model, opt, before)
    assert opt.state_dict()["skipped_steps"] == 1


def _stepped_once_and_a_fresh_twin(cls_path: str, generator):
    """An optimizer of ``cls_path`` stepped once on one matrix, its state dict (a copy), and a fresh
    optimizer of the same class on a copy of the weights, to load it into."""
    import importlib

    module, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    p = torch.nn.Parameter(torch.randn(32, 16, generator=generator))
    opt = cls([{"params": [p]}], lr=0.02)
    p.grad = torch.randn(32, 16, generator=generator)
    opt.step()
    twin = torch.nn.Parameter(p.detach().clone())
    return p, opt, copy.deepcopy(opt.state_dict()), twin, cls([{"params": [twin]}], lr=0.02)


def _step_both_and_compare(p, opt, twin, resumed, generator) -> None:
    grad = torch.randn(32, 16, generator=generator)
    p.grad, twin.grad = grad.clone(), grad.clone()
    opt.step()
    resumed.step()
    assert torch.equal(p, twin)


CHECKPOINTING_CLASSES = [
    "dion3_megatron.Dion3",
    pytest.param(
        "dion3_megatron.megatron.MegatronDion3",
        marks=NEEDS_MEGATRON,
    ),
]


@pytest.mark.parametrize("cls_path", CHECKPOINTING_CLASSES)
def test_a_checkpoint_without_a_newer_group_option_loads_with_its_default(cls_path, generator):
    """A param group saved before an option existed (here scale_mu_by_fraction, one of the later
    ones) takes the option's default on load, and the resumed step equals one from a fresh
    optimizer's state."""
    from dion3_megatron import options

    p, opt, saved, twin, resumed = _stepped_once_and_a_fresh_twin(cls_path, generator)
    for group in saved["param_groups"]:
        del group["scale_mu_by_fraction"]
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["scale_mu_by_fraction"] is options.BY_NAME["scale_mu_by_fraction"].default
    _step_both_and_compare(p, opt, twin, resumed, generator)


def test_a_misspelled_option_in_a_param_group_is_refused_with_a_hint_and_other_keys_pass():
    w = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(options.UnknownOptionError, match=r"param group 0: 'fracton' is not a Dion3 option here \(did you mean 'fraction'"):
        Dion3([{"params": [w], "fracton": 0.5}])
    unknown = options.UnknownOptionError
    with pytest.raises(unknown, match=r"param group 0: 'momentum' is not a Dion3 option here \(Dion3 calls its momentum 'mu'\)"):
        Dion3([{"params": [w], "momentum": 0.9}])
    opt = Dion3([{"params": [w], "name": "hidden", "initial_lr": 0.01, "fractions": {}}])  # frameworks' own keys
    assert opt.param_groups[0]["name"] == "hidden"
