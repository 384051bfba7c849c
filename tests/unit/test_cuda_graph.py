"""CUDA-graph replay of the Dion3 step equals the eager step bit for bit (GPU only)."""

import dataclasses

import pytest
import torch

from dion3_megatron import Dion3, options
from dion3_megatron.kernels import rows as kernel_rows
from dion3_megatron.engine import Dion3Engine, MatrixShard, Sharding

pytestmark = pytest.mark.gpu

SHAPES = [(192, 320)] * 3 + [(320, 192)] * 2 + [(256, 256)]


@pytest.fixture(autouse=True, params=[False, True], ids=["torch-rows", "row-kernels"])
def row_kernels(request, monkeypatch):
    """Every test with the rule's torch forms and with the Triton row kernels."""
    if request.param:
        pytest.importorskip("triton")
    monkeypatch.setattr(kernel_rows, "available", lambda: request.param)  # as DION3_FUSED_ROWS does


def make_params(generator, dtype):
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to("cuda", dtype)) for s in SHAPES]
    params.append(torch.nn.Parameter(torch.randn(4, 96, 160, generator=generator).to("cuda", dtype)))  # experts
    params.append(torch.nn.Parameter(torch.randn(320, generator=generator).to("cuda", dtype)))  # AdamW
    return params


def train(params, grads, lrs, cuda_graph, reload_at=None, **kwargs):
    opt = Dion3(params, lr=lrs[0], cuda_graph=cuda_graph, **kwargs)
    for step, (lr, step_grads) in enumerate(zip(lrs, grads)):
        if step == reload_at:  # new state buffers: the graph must be captured anew, not replayed
            opt.load_state_dict(opt.state_dict())
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype).clone()  # a new gradient tensor every step, as zero_grad(set_to_none) gives
        opt.step()
    return opt


@pytest.mark.parametrize("momentum_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "settings",
    [
        {"fraction": 0.25},
        {"fraction": "auto", "mu": 0.9, "scale_mu_by_fraction": True, "num_heads": 4},
        {"staleness": 1.0},
        {"fraction": 1.0, "mu": 0.9},  # the decay folded into the accumulation
        {"fraction": 1.0, "mu": 0.0},  # the decay after the orthogonalization
    ],
)
def test_dion3_graph_replay_equals_eager(generator, dtype, settings, momentum_dtype):
    """A bf16 momentum too: its rounding's noise is hashed on the device from each matrix's
    rounding_step, which the reload's state dict carries."""
    settings = {**settings, "momentum_dtype": momentum_dtype}
    steps = 8
    base = make_params(generator, dtype)
    grads = [[torch.randn(p.shape, generator=generator).cuda() for p in base] for _ in range(steps)]
    lrs = [0.02 * (0.8**i) for i in range(steps)]  # lr changes every step: it must reach the graph
    eager = [torch.nn.Parameter(p.detach().clone()) for p in base]
    graphed = [torch.nn.Parameter(p.detach().clone()) for p in base]
    opt_eager = train(eager, grads, lrs, cuda_graph=False, reload_at=5, **settings)
    opt_graphed = train(graphed, grads, lrs, cuda_graph=True, reload_at=5, **settings)
    assert opt_graphed._whole.session.engine._graph.graph is not None and opt_eager._whole.session.engine._graph.graph is None
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    for a, b in zip(eager, graphed):
        for key, value in opt_eager.state[a].items():
            assert torch.equal(value, opt_graphed.state[b][key]), key
    if momentum_dtype == "bf16":
        assert opt_graphed.state[graphed[0]]["momentum"].dtype == torch.bfloat16
        assert opt_graphed.state[graphed[0]]["rounding_step"].tolist() == [steps]


def engine_run(weights, grads, lrs, cuda_graph, staleness=0.0, momentum_dtype="fp32"):
    hp = options.hyperparameters(
        fraction=0.25, weight_decay=0.1, scale_mu_by_fraction=True, staleness=staleness, momentum_dtype=momentum_dtype
    )
    shards = [MatrixShard(f"m{j}", w, g, tuple(w.shape), Sharding.full(), None, hp) for j, (w, g) in enumerate(zip(weights, grads[0]))]
    engine = Dion3Engine(shards, cuda_graph=cuda_graph)
    for lr, step_grads in zip(lrs, grads):
        for shard, g in zip(shards, step_grads):
            shard.hp = dataclasses.replace(hp, lr=lr)
            shard.grad.copy_(g)  # stable gradient buffers, as Megatron's main grads are
        engine.step()
    return engine, shards


@pytest.mark.parametrize("momentum_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("staleness", [0.0, 1.0])
def test_engine_local_groups_graph_replay_equals_eager(generator, staleness, momentum_dtype):
    """Stable gradient buffers: the accumulation (and a bf16 momentum's count of steps) replays in the graph."""
    steps = 6
    shapes = [(256, 128)] * 4 + [(128, 256)] * 2
    weights = [torch.randn(s, generator=generator).cuda() for s in shapes]
    grads = [[torch.randn(s, generator=generator).cuda() for s in shapes] for _ in range(steps)]
    lrs = [0.01 * (i + 1) for i in range(steps)]
    runs = []
    for use_graph in (False, True):
        copies = [w.clone() for w in weights]
        buffers = [[g.clone() for g in grads[0]]] + grads[1:]
        runs.append(engine_run(copies, buffers, lrs, use_graph, staleness, momentum_dtype))
    (eager, eager_shards), (graphed, graphed_shards) = runs
    assert graphed._graph.graph is not None and eager._graph.graph is None
    rounded = {"rounding_step"} if momentum_dtype == "bf16" else set()
    for a, b in zip(eager_shards, graphed_shards):
        assert torch.equal(a.weight, b.weight)
        assert a.state.keys() == b.state.keys() == ({"momentum", "variance"} | ({"row_age"} if staleness else set()) | rounded)
        for key in a.state:
            assert torch.equal(a.state[key], b.state[key]), key


def flat_slice_run(generator, staleness, use_graph, device="cuda", steps=5):
    """The ZeRO layout: matrices a rank holds whole as ``Sharding.full()`` shards on views of one
    flat slice, beside a matrix on the general exchange (one straddling slices; here its only
    piece), so the engine steps the whole ones from a graph of their own while the other waits for
    its rows; every step's gradients are views of a new tensor (``fresh_grads``), and lr changes."""
    shapes = [(64, 96)] * 3 + [(96, 64)] * 2 + [(80, 48)]
    gen = torch.Generator().manual_seed(generator.initial_seed())
    flat = torch.randn(sum(n * m for n, m in shapes), generator=gen).to(device)
    grads = [torch.randn(flat.shape, generator=gen).to(device) for _ in range(steps)]  # all alive: new addresses
    hp = options.hyperparameters(fraction=0.25, weight_decay=0.1, staleness=staleness)
    shards, offsets = [], [0]
    for j, (n, m) in enumerate(shapes):
        whole = j < len(shapes) - 1
        view = flat.narrow(0, offsets[-1], n * m)
        shards.append(
            MatrixShard(
                f"m{j}", view.view(n, m) if whole else view, None, (n, m), Sharding.full() if whole else Sharding.flat([0, n * m]), None, hp
            )
        )
        offsets.append(offsets[-1] + n * m)
    engine = Dion3Engine(shards, cuda_graph=use_graph, fresh_grads=True)
    for step in range(steps):
        for shard, offset in zip(shards, offsets):
            shard.grad = grads[step].narrow(0, offset, shard.weight.numel()).view(shard.weight.shape)
            shard.hp = dataclasses.replace(hp, lr=0.01 / (step + 1))
        engine.step()
    return engine, flat, shards


@pytest.mark.parametrize("staleness", [0.0, 1.0])
def test_whole_shards_on_a_flat_slice_beside_a_split_one_graph_equals_eager(generator, staleness):
    (eager, eager_flat, eager_shards), (graphed, graphed_flat, graphed_shards) = (
        flat_slice_run(generator, staleness, use_graph) for use_graph in (False, True)
    )
    assert not graphed._whole_step_graphable()  # the general exchange waits for its rows on the host
    assert graphed._graph.graph is not None and eager._graph.graph is None
    assert torch.equal(eager_flat, graphed_flat)
    for a, b in zip(eager_shards, graphed_shards):
        assert a.state.keys() == b.state.keys() == ({"momentum", "variance"} | ({"row_age"} if staleness else set()))
        for key in a.state:
            assert torch.equal(a.state[key], b.state[key]), key


@pytest.mark.parametrize("staleness", [0.0, 1.0])
@pytest.mark.parametrize("stable_grads", [True, False], ids=["grad-buffers", "new-grads"])
def test_megatron_dion3_with_fused_qkv_graph_equals_eager(generator, stable_grads, staleness):
    """MegatronDion3's step with a fused QKV weight: the row permutation into Q, K, V and back runs
    inside the graph (its prologue and epilogue). Stable gradient buffers (Megatron's fp32 main
    grads) replay the graph; a new gradient tensor every step changes the graph's key."""
    pytest.importorskip("megatron.core")
    from dion3_megatron.megatron import MegatronDion3, describe_param

    groups, split, cols, steps = 4, [64, 32, 32], 192, 6
    shapes = {
        "layers.0.self_attention.linear_qkv.weight": (groups * sum(split), cols),
        "layers.0.mlp.linear_fc1.weight": (256, cols),
        "layers.0.self_attention.linear_proj.weight": (cols, 128),
    }
    base = [torch.randn(s, generator=generator).cuda() for s in shapes.values()]
    grads = [[torch.randn(s, generator=generator).cuda() for s in shapes.values()] for _ in range(steps)]
    runs = []
    for use_graph in (False, True):
        params = [torch.nn.Parameter(b.clone()) for b in base]
        params[0].is_qkv, params[0].qkv_split_shapes = True, split
        layouts = {p: describe_param(name, p, gated_linear_unit=True) for p, name in zip(params, shapes)}
        opt = MegatronDion3(
            [{"params": params}], lr=0.02, weight_decay=0.1, fraction=0.25, layouts=layouts, cuda_graph=use_graph, staleness=staleness
        )
        for step in range(steps):
            opt.param_groups[0]["lr"] = 0.02 * 0.8**step
            for p, g in zip(params, grads[step]):
                if stable_grads and p.grad is not None:
                    p.grad.copy_(g)
                else:
                    p.grad = g.clone()
            opt.step()
        runs.append((opt, params))
    (eager, eager_params), (graphed, graphed_params) = runs
    assert eager._session.engine._graph.graph is None
    if stable_grads:
        assert graphed._session.engine._graph.graph is not None
    for a, b in zip(eager_params, graphed_params):
        assert torch.equal(a, b)
    for a, b in zip(eager_params, graphed_params):
        assert all(torch.equal(x, y) for x, y in zip(eager._param_state(a), graphed._param_state(b)))
    assert not torch.equal(eager_params[0], base[0])  # the QKV weight moved: the epilogue wrote it back
