"""The engine on 2 GPUs over NCCL: the step equals the single-process one, and its whole step
replayed from one CUDA graph equals the eager steps."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dion3_megatron import Dion3, options
from dion3_megatron.engine import Dion3Engine, MatrixShard, Sharding
from support.dist_utils import run_distributed

pytestmark = pytest.mark.gpu


def nccl_worker(rank, world, seed, fraction, staleness, steps=3):
    """Row and column blocks over NCCL for a few steps: at f = 1/4 the static exchange, at f = 1
    the host-planned one (row blocks)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(512, 256)] * 3 + [(256, 512)] * 2
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    hp = options.hyperparameters(fraction=fraction, ns_dtype=torch.float32, staleness=staleness)
    group = dist.new_group(list(range(world)))
    shards = []

    def piece(t, j, sharding):
        lo, hi = sharding.bounds[rank], sharding.bounds[rank + 1]
        return (t[lo:hi] if j % 2 else t[:, lo:hi]).contiguous().cuda()

    for j, (w, s) in enumerate(zip(weights, shapes)):
        sharding = Sharding.even_rows(s[0], world) if j % 2 else Sharding.even_cols(s[1], world)
        shards.append(MatrixShard(f"m{j}", piece(w, j, sharding), None, s, sharding, group, hp))
    engine = Dion3Engine(shards)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Dion3(params, fraction=fraction, ns_dtype=torch.float32, staleness=staleness)
    for step in range(steps):
        for j, shard in enumerate(shards):
            shard.grad = piece(grads[step][j], j, shard.sharding)
        engine.step()
        for p, g in zip(params, grads[step]):
            p.grad = g
        opt.step()
    errors = []
    for j, (shard, p) in enumerate(zip(shards, params)):
        lo, hi = shard.sharding.bounds[rank], shard.sharding.bounds[rank + 1]
        ref = p.detach()[lo:hi] if j % 2 else p.detach()[:, lo:hi]
        errors.append(((shard.weight.cpu() - ref).norm() / ref.norm()).item())
    return max(errors)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("fraction,staleness", [(0.25, 0.0), (1.0, 0.0), (0.25, 1.0)])
@pytest.mark.parametrize("row_kernels", ["0", "1"], ids=["torch-rows", "row-kernels"])
def test_engine_over_nccl_equals_single_process(fraction, staleness, row_kernels, monkeypatch):
    monkeypatch.setenv("DION3_FUSED_ROWS", row_kernels)  # read by the spawned ranks
    errors = run_distributed(nccl_worker, 2, torch.seed() % 2**31, fraction, staleness, backend="nccl")
    assert max(errors) <= 1e-4  # TF32-free fp32 on GPU vs CPU fp32: rounding only


def nccl_graph_worker(rank, world, seed, staleness, steps=6):
    """Row blocks, column blocks and a matrix held whole, each with its own lr schedule: the
    engine's whole step replayed from one CUDA graph (collectives inside) against eager steps."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(512, 256)] * 3 + [(256, 512)] * 2 + [(128, 384)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    group = dist.new_group(list(range(world)))

    def sharding_of(j, shape):
        return [Sharding.even_cols(shape[1], world), Sharding.even_rows(shape[0], world), Sharding.full()][j % 3]

    def piece(t, sharding):
        if sharding.kind == "full":
            return t.clone().cuda()
        lo, hi = sharding.bounds[rank], sharding.bounds[rank + 1]
        return (t[lo:hi] if sharding.kind == "rows" else t[:, lo:hi]).contiguous().cuda()

    runs = []
    for use_graph in (False, True):
        hp = options.hyperparameters(fraction=0.25, weight_decay=0.1, ns_dtype=torch.float32, staleness=staleness)
        shards = []
        for j, (w, s) in enumerate(zip(weights, shapes)):
            sharding = sharding_of(j, s)
            shards.append(
                MatrixShard(
                    f"m{j}", piece(w, sharding), piece(grads[0][j], sharding), s, sharding, None if sharding.kind == "full" else group, hp
                )
            )
        engine = Dion3Engine(shards, cuda_graph=use_graph)
        for step in range(steps):
            for j, shard in enumerate(shards):
                shard.hp = dataclasses.replace(hp, lr=0.01 * (step + 1) * (1 + j % 2))
                shard.grad.copy_(piece(grads[step][j], shard.sharding))  # stable buffers, as Megatron's
            engine.step()
        runs.append((engine, shards))
    (eager, eager_shards), (graphed, graphed_shards) = runs
    assert graphed._graph.graph is not None and eager._graph.graph is None
    assert graphed._whole_step_graphable()
    return all(
        torch.equal(a.weight, b.weight)
        and a.state.keys() == b.state.keys()
        and all(torch.equal(a.state[key], b.state[key]) for key in a.state)
        for a, b in zip(eager_shards, graphed_shards)
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("staleness", [0.0, 1.0])
@pytest.mark.parametrize("row_kernels", ["0", "1"], ids=["torch-rows", "row-kernels"])
def test_engine_whole_step_graph_over_nccl_equals_eager(row_kernels, staleness, monkeypatch):
    monkeypatch.setenv("DION3_FUSED_ROWS", row_kernels)  # read by the spawned ranks
    assert all(run_distributed(nccl_graph_worker, 2, torch.seed() % 2**31, staleness, backend="nccl"))
