"""Offloaded state (dion3_megatron/engine/offload.py): the engine keeps a shape group's state in host
memory and steps the group on a device it copies the state to (on a GPU, pinned memory and side
streams: tests/unit/test_offload_gpu.py). Here the device is the CPU itself, so every copy in and out,
every tensor put in place and back, runs as on a GPU: the offloaded step equals the step without
offload bit for bit, for whole matrices, for weights held on the host (DeepSpeed's ZeRO-Offload)
and for each exchange of split matrices (two processes, the last tests here). Without a GPU the
front ends' ``offload`` changes nothing, as documented."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch

from dion3_megatron import Dion3, options
from dion3_megatron.engine import Dion3Engine, MatrixShard, Sharding, offload
from dion3_megatron.engine.local import WholeExchange

CPU = torch.device("cpu")
SHAPES = [(24, 40)] * 3 + [(40, 24)] * 2 + [(16, 48)]  # three shape groups


def whole_engine(device, fraction=0.25, staleness=1.0, seed=0, steps=4, in_place=False, momentum_dtype="fp32"):
    """Whole matrices stepped ``steps`` times by an engine offloaded to ``device`` (None: not);
    ``in_place``: their momentum is given as views of one flat tensor and stepped where it lies
    (DeepSpeed's exp_avg). Returns (weights, states, engine, the flat momentum)."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in SHAPES]
    hp = options.hyperparameters(fraction=fraction, staleness=staleness, mu=0.9, ns_dtype=torch.float32, momentum_dtype=momentum_dtype)
    flat = torch.zeros(sum(n * m for n, m in SHAPES))
    shards, offset = [], 0
    for j, (w, (n, m)) in enumerate(zip(weights, SHAPES)):
        state = {"momentum": flat[offset : offset + n * m].view(n, m)} if in_place else {}
        shards.append(MatrixShard(f"m{j}", w, None, (n, m), Sharding.full(), None, hp, state))
        offset += n * m
    engine = Dion3Engine(shards, local=True, fresh_grads=True, momentum_in_place=in_place, offload=device)
    for _ in range(steps):
        for shard in shards:
            shard.grad = torch.randn(shard.shape, generator=gen)
        engine.step()
    return weights, [dict(s.state) for s in shards], engine, flat


def assert_equal_states(a, b):
    assert [sorted(s) for s in a] == [sorted(s) for s in b]
    for x, y in zip(a, b):
        for key in x:
            assert torch.equal(x[key], y[key]), key


@pytest.mark.parametrize(
    "fraction,staleness,momentum_dtype", [(0.25, 1.0, "fp32"), (1.0, 0.0, "fp32"), (0.5, 0.0, "fp32"), (0.25, 1.0, "bf16")]
)
def test_an_offloaded_step_of_whole_matrices_equals_the_step_without(fraction, staleness, momentum_dtype):
    """Also with a bf16 momentum, whose count of steps (the rounding's) travels with it."""
    weights, states, _, _ = whole_engine(None, fraction, staleness, momentum_dtype=momentum_dtype)
    offloaded, offloaded_states, engine, _ = whole_engine(CPU, fraction, staleness, momentum_dtype=momentum_dtype)
    for a, b in zip(weights, offloaded):
        assert torch.equal(a, b)
    assert_equal_states(states, offloaded_states)
    assert len(engine.exchanges) == 3 and all(isinstance(ex, WholeExchange) for ex in engine.exchanges)


def test_each_group_steps_on_copies_of_its_state_and_weights_which_are_then_put_back(monkeypatch):
    """During a group's step the exchange holds device copies (here fresh CPU tensors), not the host
    buffers (a bf16 momentum's count of steps too); after it, the host buffers and weights again,
    holding the result."""
    seen = []
    step_all = WholeExchange.step_all

    def pointers(ex):
        sub = ex.subs[0]
        return (sub.momentum.data_ptr(), ex.sg.shards[0].weight.data_ptr(), sub.rounding.steps.data_ptr())

    def recording(exchanges, graph, factors=None):
        seen.extend(pointers(ex) for ex in exchanges)
        step_all(exchanges, graph, factors)

    monkeypatch.setattr(WholeExchange, "step_all", staticmethod(recording))
    weights, states, engine, _ = whole_engine(CPU, steps=1, momentum_dtype="bf16")
    held = [pointers(ex) for ex in engine.exchanges]
    assert len(seen) == 3 and all(a != b for during in seen for host in held for a, b in zip(during, host))
    for ex in engine.exchanges:  # the host tensors again, the shards' state views of them
        assert ex.sg.shards[0].weight.data_ptr() in {w.data_ptr() for w in weights}
        assert ex.sg.shards[0].state["momentum"].data_ptr() == ex.subs[0].momentum[0].data_ptr()


def test_momentum_stepped_in_place_is_written_back_where_it_lies():
    """DeepSpeed's ZeRO slices: the momentum is the caller's flat tensor, in host memory with the
    weights; the offloaded step leaves in that tensor what the step without offload leaves."""
    weights, states, _, flat = whole_engine(None, in_place=True)
    offloaded, offloaded_states, _, offloaded_flat = whole_engine(CPU, in_place=True)
    assert flat.abs().sum() > 0 and torch.equal(flat, offloaded_flat)
    for a, b in zip(weights, offloaded):
        assert torch.equal(a, b)
    assert_equal_states(states, offloaded_states)


def test_the_state_of_an_offloaded_engine_lives_in_host_memory_pinned_for_a_gpu():
    assert Sharding  # (the placement rule itself; a GPU run checks the pinning: tests/unit/test_offload_gpu.py)
    from dion3_megatron.engine.sharding import state_placement

    assert state_placement(None, torch.device("cuda", 1)) == (torch.device("cuda", 1), False)
    assert state_placement(torch.device("cuda", 0), torch.device("cuda", 0)) == (CPU, True)
    assert state_placement(CPU, CPU) == (CPU, False)


def test_without_a_gpu_offload_has_no_device_to_stream_to(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert offload.step_device(True, CPU) is None and offload.step_device(False, CPU) is None
    assert offload.step_device(True, torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert offload.step_device(False, torch.device("cuda", 1)) is None


def test_step_on_device_runs_elementwise_work_in_bounded_chunks():
    """AdamW on ZeRO's host partitions: runs cut into chunks, each copied, stepped, written back."""
    runs = [torch.arange(10.0), torch.arange(3.0)]
    grads = [torch.ones(10), torch.ones(3)]
    chunks = []

    def add(read, written):
        chunks.append(written[0][0].numel())
        written[0][0].add_(read[0][0])

    offload.step_on_device(CPU, [grads], [runs], add, chunk=4)
    assert chunks == [4, 4, 2, 3]
    assert torch.equal(runs[0], torch.arange(10.0) + 1) and torch.equal(runs[1], torch.arange(3.0) + 1)


# --------------------------------------------------------------------------------------------
# The torch front end.


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16), torch.nn.Linear(16, 16, bias=False))


def train(net, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()


def test_dion3_offload_without_a_gpu_changes_nothing(monkeypatch):
    """The documented CPU behaviour: the state is in host memory already; the engine steps as
    without offload, and so does every step."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plain, offloaded = model(), model()
    opt, opt_offloaded = Dion3(plain.parameters(), fraction=0.5), Dion3(offloaded.parameters(), fraction=0.5, offload=True)
    train(plain, opt, 3)
    train(offloaded, opt_offloaded, 3)
    assert opt_offloaded.offload and opt_offloaded._whole.session.engine.offload is None
    for a, b in zip(plain.parameters(), offloaded.parameters()):
        assert torch.equal(a, b)


HOST_STEP = "their step runs on the host's cores; Dion3(..., offload=True) streams it through the GPU"


@pytest.mark.parametrize("gpu", [True, False], ids=["a-gpu-present", "no-gpu"])
def test_matrices_in_host_memory_beside_a_gpu_say_once_that_offload_streams_their_step(monkeypatch, caplog, gpu):
    """Host matrices (FSDP2's CPUOffloadPolicy) stepped without offload where a GPU is present:
    one warning naming offload=True, at the step that builds the engine; none without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    net = model()
    opt = Dion3(net.parameters(), fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="dion3_megatron"):
        train(net, opt, 2)
    assert sum(HOST_STEP in r.getMessage() for r in caplog.records) == (1 if gpu else 0), caplog.text


@pytest.fixture
def offloaded_to_the_cpu(monkeypatch):
    """The front ends' offload, with the CPU standing in for the GPU: every copy runs as on one."""
    monkeypatch.setattr(offload, "step_device", lambda on, device: CPU if on else None)


def test_dion3_offloaded_steps_and_state_dict_equal_the_step_without(offloaded_to_the_cpu):
    plain, offloaded = model(), model()
    opt, opt_offloaded = Dion3(plain.parameters(), fraction=0.5), Dion3(offloaded.parameters(), fraction=0.5, offload=True)
    train(plain, opt, 3)
    train(offloaded, opt_offloaded, 3)
    assert opt_offloaded._whole.session.engine.offload == CPU
    for a, b in zip(plain.parameters(), offloaded.parameters()):
        assert torch.equal(a, b)
    saved, saved_offloaded = opt.state_dict(), opt_offloaded.state_dict()
    for pid, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(value, saved_offloaded["state"][pid][key]), (pid, key)
    # A resume of the offloaded run continues as the uninterrupted one.
    buffer = io.BytesIO()
    torch.save(saved_offloaded, buffer)
    resumed = copy.deepcopy(offloaded)
    opt_resumed = Dion3(resumed.parameters(), fraction=0.5, offload=True)
    buffer.seek(0)
    opt_resumed.load_state_dict(torch.load(buffer))
    train(offloaded, opt_offloaded, 2, seed=2)
    train(resumed, opt_resumed, 2, seed=2)
    for a, b in zip(offloaded.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_offload_is_a_bool_of_the_whole_optimizer():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="offload must be a bool, got 'yes'"):
        Dion3([p], offload="yes")
    with pytest.raises(ValueError, match="'offload' is one value per optimizer"):
        Dion3([{"params": [p], "offload": True}])


# --------------------------------------------------------------------------------------------
# Split matrices: every exchange, over 2 ranks.


def _split_engine_run(rank, world, shardings, fraction, device, staleness, momentum_dtype):
    """Pieces of matrices of two shapes, split as ``shardings`` says, stepped 3 times over the
    world (gloo) by an engine offloaded to ``device`` (None: not): (weights, states, exchanges)."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(7)
    shapes = [(12, 20)] * 3 + [(20, 12)] * 3
    hp = options.hyperparameters(fraction=fraction, staleness=staleness, mu=0.9, ns_dtype=torch.float32, momentum_dtype=momentum_dtype)
    group = dist.new_group(list(range(world)))
    shards, fulls = [], []
    for j, (n, m) in enumerate(shapes):
        full = torch.randn(n, m, generator=gen)
        kind = shardings[j % len(shardings)]
        if kind == "rows":
            sharding = Sharding.even_rows(n, world)
            piece = full[sharding.bounds[rank] : sharding.bounds[rank + 1]].clone()
        elif kind == "cols":
            sharding = Sharding.even_cols(m, world)
            piece = full[:, sharding.bounds[rank] : sharding.bounds[rank + 1]].contiguous()
        else:  # a ZeRO-like slice: partial rows
            sharding = Sharding.flat([0, n * m // 2 + 3 + j, n * m])
            piece = full.reshape(-1)[sharding.bounds[rank] : sharding.bounds[rank + 1]].clone()
        shards.append(MatrixShard(f"m{j}", piece, None, (n, m), sharding, group, hp))
        fulls.append(full)
    engine = Dion3Engine(shards, offload=device)
    for _ in range(3):
        for shard in shards:
            shard.grad = torch.randn(shard.weight.shape, generator=gen)
        engine.step()
    return [s.weight for s in shards], [dict(s.state) for s in shards], sorted({type(ex).__name__ for ex in engine.exchanges})


def split_worker(rank, world, cases):
    out = []
    for case in cases:
        weights, states, exchanges = _split_engine_run(rank, world, *case[:2], None, *case[2:])
        offloaded, offloaded_states, _ = _split_engine_run(rank, world, *case[:2], CPU, *case[2:])
        diff = max((a - b).abs().max().item() for a, b in zip(weights, offloaded))
        state_diff = max((x[k] - y[k]).abs().max().item() for x, y in zip(states, offloaded_states) for k in x if x[k].numel())
        moved = max(s["momentum"].float().abs().max().item() for s in states)
        out.append((exchanges, diff, state_diff, moved))
    return out


SPLIT_CASES = [
    (("rows", "cols"), 0.25, 1.0, "fp32"),  # the static exchange (row and column blocks)
    (("rows",), 1.0, 0.0, "fp32"),  # the host-planned one (f x world > 1)
    (("flat", "rows"), 0.25, 1.0, "fp32"),  # the general one (ZeRO-like slices), with a static one
    (("flat", "cols"), 0.25, 1.0, "bf16"),  # a bf16 momentum: its count of steps travels with it
]


@pytest.mark.slow
def test_an_offloaded_step_of_split_matrices_equals_the_step_without_on_every_exchange():
    from support.dist_utils import run_distributed

    per_rank = run_distributed(split_worker, 2, SPLIT_CASES)
    for rank, results in enumerate(per_rank):
        for case, (exchanges, diff, state_diff, moved) in zip(SPLIT_CASES, results):
            assert moved > 0 and diff == 0.0 and state_diff == 0.0, (rank, case, diff, state_diff)
    covered = {name for results in per_rank for exchanges, *_ in results for name in exchanges}
    assert covered == {"StaticExchange", "PlannedExchange", "GeneralExchange"}, covered


# (name, shape, placements) of DTensor parameters on a 1-D mesh (FSDP2's row pieces, tensor
# parallelism's column pieces) and on a 2 x 2 one (HSDP: replicas of row pieces; FSDP2 over tensor
# parallelism; and blocks of both).
DTENSOR_LAYOUTS = {
    "1-D": [("rows", (24, 40), ["S0"]), ("cols", (40, 24), ["S1"]), ("rows2", (24, 40), ["S0"])],
    "2-D": [("hsdp", (24, 40), ["R", "S0"]), ("fsdp-tp", (40, 24), ["S0", "S1"]), ("blocks", (24, 40), ["S1", "S0"])],
}


def _dtensor_run(rank, world, layout, offloaded, momentum_dtype):
    """DTensor parameters placed as ``DTENSOR_LAYOUTS[layout]``, three steps of fresh gradients by
    a Dion3 offloaded to the CPU standing in for a GPU (or not): this rank's pieces of the weights
    and of their state, and where the state lies."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if offloaded:  # (each process of its own: the fixture's patch, made here)
        offload.step_device = lambda on, device: CPU if on else None
    mesh = init_device_mesh("cpu", (world,) if layout == "1-D" else (2, world // 2))
    placement = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    gen = torch.Generator().manual_seed(3)
    placed = [(name, shape, [placement[p] for p in where]) for name, shape, where in DTENSOR_LAYOUTS[layout]]
    params = [
        (name, torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen), mesh, where))) for name, shape, where in placed
    ]
    opt = Dion3(params, lr=0.05, fraction=0.5, staleness=1.0, ns_dtype=torch.float64, momentum_dtype=momentum_dtype, offload=offloaded)
    for _ in range(3):
        for (_, shape, where), (_, p) in zip(placed, params):
            p.grad = distribute_tensor(torch.randn(shape, generator=gen), mesh, where)
        opt.step()
    engine = opt._whole.session.engine
    states = {name: {part: v.to_local().clone() for part, v in opt.state[p].items()} for name, p in params}
    return {name: p.to_local().detach().clone() for name, p in params}, states, engine.offload


def dtensor_worker(rank, world):
    out = []
    for layout in DTENSOR_LAYOUTS:
        for momentum_dtype in ("fp32", "bf16"):
            weights, states, _ = _dtensor_run(rank, world, layout, False, momentum_dtype)
            weights_offloaded, states_offloaded, device = _dtensor_run(rank, world, layout, True, momentum_dtype)
            out.append((weights, states, weights_offloaded, states_offloaded, str(device)))
    return out


@pytest.mark.slow
def test_an_offloaded_step_of_dtensor_parameters_equals_the_step_without():
    """offload=True with DTensor parameters (FSDP2's CPUOffloadPolicy, on a GPU, streams their
    host pieces through it), on 4 ranks, on a 1-D mesh and on a 2 x 2 one: the same weights and
    state pieces, bit for bit."""
    from support.dist_utils import run_distributed

    for rank_results in run_distributed(dtensor_worker, 4):
        for weights, states, weights_offloaded, states_offloaded, device in rank_results:
            assert device == "cpu"  # the engine streamed to its stand-in device
            for name in weights:
                assert torch.equal(weights[name], weights_offloaded[name]), name
                assert sorted(states[name]) == sorted(states_offloaded[name]), name
                for part, value in states[name].items():
                    assert torch.equal(value, states_offloaded[name][part]), (name, part)
            moved = max(s["momentum"].float().abs().max().item() for s in states.values())
            assert moved > 0
