"""DTensor parameters on CPU over gloo: FSDP2 (``fully_shard``) on a 1-D mesh, HSDP on a 2-D one,
FSDP2 with tensor parallelism, 3-D experts sharded by experts or split inside their matrices. The
torch ``Dion3`` steps each rank's piece as a piece of the whole logical matrices, and every step
equals the single-process step on the full matrices, with uneven and empty shards; checkpoints
reshard."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Optional

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from support.dist_utils import run_distributed
from support.equality import TOL
from support.repository import ROOT

pytestmark = pytest.mark.slow  # multi-process

# Row counts at 2 ranks: 34 -> 17/17 (with tensor parallelism 2 x 2: 9/8 of each 17-row block),
# 3 -> 2/1 (at 4 ranks 1/1/1/0: an empty shard); the experts (3, 7, 7) -> 2/1 experts (1/1/1/0).
STEPS = 3


class _Net(torch.nn.Module):
    """Two layers that tensor parallelism splits (by rows, then by columns), a small head and a
    3-D batch of expert matrices."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 34)
        self.down = torch.nn.Linear(34, 7)
        self.head = torch.nn.Linear(7, 3)
        self.experts = torch.nn.Parameter(0.3 * torch.randn(3, 7, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.tanh(self.up(x)))
        return self.head(h + torch.einsum("bi,eoi->bo", h, self.experts) / 3)


MATRICES = {"up.weight", "down.weight", "head.weight", "experts"}


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=gen) for _ in range(STEPS)]


def _sharded(world: int, layout: str, settings: dict):
    """The model on ``world`` ranks: "fsdp" (a 1-D mesh), "hsdp" (2 x world/2: replicas of a
    sharded model), "tp" (tensor parallelism 2 inside, FSDP2 over world/2: up by rows, down by
    columns), "offload" (a 1-D mesh with ``CPUOffloadPolicy``: the pieces, their gradients and so
    Dion3's state on the CPU; on CPU processes without page-locking, which needs CUDA) or
    "offload-cuda" (the same on a CUDA mesh: the forward and backward on the GPU, the pieces in
    page-locked CPU memory), and its Dion3."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from dion3_megatron import Dion3

    model = _Net()
    if layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    elif layout.startswith("offload"):
        on_cuda = layout == "offload-cuda"
        mesh = init_device_mesh("cuda" if on_cuda else "cpu", (world,))
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=on_cuda))
    elif layout == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    return model, Dion3(model.named_parameters(), lr=0.05, ns_dtype=torch.float64, **settings)


def _train(rank: int, world: int, layout: str, settings: dict, bad_step: int) -> dict:
    model, opt = _sharded(world, layout, settings)
    device = model.up.weight.device_mesh.device_type  # where the forward runs: the mesh's device
    for step, x in enumerate(_batches()):  # every rank the same batch: FSDP's averaged gradient is that batch's
        opt.zero_grad()
        model(x.to(device)).square().mean().backward()
        if step == bad_step and rank == world - 1:
            model.up.weight.grad.to_local().view(-1)[0] = float("nan")
        opt.step()
    return {
        "params": {n: p.detach().full_tensor().cpu().clone() for n, p in model.named_parameters()},
        "skipped": opt.skipped_steps,
        "fractions": dict(opt.fractions),
        "held": _held_where(model, opt),
        **({"dion3 state": _dion3_state(model, opt)} if "momentum_dtype" in settings else {}),
        **({"streamed to": str(opt._whole.session.engine.offload)} if settings.get("offload") else {}),
    }


def _dion3_state(model: torch.nn.Module, opt) -> dict[str, dict[str, tuple]]:
    """Each Dion3 matrix's state, gathered whole, with the placements of its DTensors."""
    return {
        n: {part: (v.full_tensor().cpu().clone(), tuple(v.placements)) for part, v in opt.state[p].items()}
        for n, p in model.named_parameters()
        if n in MATRICES
    }


def _held_where(model: torch.nn.Module, opt) -> dict:
    """The device types of this rank's pieces of the weights, their gradients and the optimizer's
    state; whether the weights' pieces are page-locked, and whether FSDP2 offloads them all."""
    from dion3_megatron.frontend.dtensor import local

    params = list(model.parameters())
    # (FSDP2 has no public accessor of the policy a module was sharded with; newer torch holds a
    # list of param groups where older holds one)
    fsdp = model._get_fsdp_state()
    groups = getattr(fsdp, "_fsdp_param_groups", None) or [fsdp._fsdp_param_group]
    fsdp_params = [fp for group in groups for fp in group.fsdp_params]
    return {
        "weights": {local(p).device.type for p in params},
        "gradients": {local(p.grad).device.type for p in params if p.grad is not None},
        "state": {local(v).device.type for p in params for v in opt.state[p].values() if v.dim()},  # (AdamW's step: a scalar)
        "pinned": all(local(p).is_pinned() for p in params),
        "offloaded": all(fp.offload_to_cpu for fp in fsdp_params),
    }


def _session(rank: int, world: int, cases: list[tuple[str, dict, int]]) -> dict:
    """Every case on one process group (start-up dominates a tiny model's cost)."""
    return {"cases": [_train(rank, world, layout, settings, bad_step) for layout, settings, bad_step in cases]}


def _two_rank_session(rank: int, world: int, checkpoint: str) -> dict:
    """Every two-rank run of this file on one process group: the cases, the offloaded ones, the
    refusals, the first steps of the checkpoint tests (saved in ``checkpoint``), the bf16
    checkpoint's resume and those under CPUOffloadPolicy, saved, resumed and run uninterrupted; last
    the runs whose steps are refused on every rank."""
    out = _session(rank, world, CASES[2])
    out["offload"] = _session(rank, world, OFFLOAD_CASES)["cases"]
    out["refused"] = _refusals(world)
    out["split experts"] = _experts_split_inside(world)
    out["pieces in cpu memory"] = _pieces_in_cpu_memory_of_a_cuda_mesh(rank, world)
    _dcp_worker(rank, world, "fsdp", checkpoint, range(0, 2), DCP_SETTINGS)
    _dcp_worker(rank, world, "fsdp", checkpoint + "-bf16", range(0, 2), BF16)
    out["bf16 resumed"] = _dcp_worker(rank, world, "fsdp", checkpoint + "-bf16", range(2, STEPS), BF16)
    for tag, settings in OFFLOAD_CHECKPOINTS.items():  # saved under CPUOffloadPolicy, resumed under it
        _dcp_worker(rank, world, "offload", f"{checkpoint}-{tag}", range(0, 2), settings)
        out[f"{tag} resumed"] = _dcp_worker(rank, world, "offload", f"{checkpoint}-{tag}", range(2, STEPS), settings)
        out[f"{tag} uninterrupted"] = _dcp_worker(rank, world, "offload", None, range(0, STEPS), settings)
    out["auto resumed"] = _auto_resumed(world, checkpoint + "-auto")
    out["gradient changed"] = _gradient_changed_at_a_later_step(rank, world)
    out["outside the mesh"] = _outside_the_mesh(rank, world)
    return out


def _four_rank_session(rank: int, world: int, checkpoint: str) -> dict:
    """The cases at four ranks, then the two-rank session's checkpoint resumed with tensor parallelism."""
    out = _session(rank, world, CASES[4])
    out["resumed"] = _dcp_worker(rank, world, "tp", checkpoint, range(2, STEPS), DCP_SETTINGS)
    return out


def _resumed_alone(rank: int, world: int, checkpoint: str) -> dict:
    """The two-rank session's checkpoints, fp32 and bf16 momentum, resumed at one rank; those saved
    under CPUOffloadPolicy resumed without it."""
    return {
        "fp32": _dcp_worker(rank, world, "fsdp", checkpoint, range(2, STEPS), DCP_SETTINGS),
        "bf16": _dcp_worker(rank, world, "fsdp", checkpoint + "-bf16", range(2, STEPS), BF16),
        **{tag: _dcp_worker(rank, world, "fsdp", f"{checkpoint}-{tag}", range(2, STEPS), s) for tag, s in OFFLOAD_CHECKPOINTS.items()},
    }


def _single_process_run(settings: dict, bad_step: int):
    """The model and its Dion3 after the steps of one process on the whole matrices."""
    from dion3_megatron import Dion3

    model = _Net()
    opt = Dion3(model.named_parameters(), lr=0.05, ns_dtype=torch.float64, **settings)
    for step, x in enumerate(_batches()):
        opt.zero_grad()
        model(x).square().mean().backward()
        if step == bad_step:
            continue  # what a skipped step does: nothing
        opt.step()
    return model, opt


def _single_process(settings: dict, bad_step: int) -> dict:
    model, _ = _single_process_run(settings, bad_step)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


STALENESS, SKIP, AUTO = ({"fraction": 0.25, "staleness": 1.0}, -1), ({"fraction": 0.5}, 1), ({}, -1)
DCP_SETTINGS = {"fraction": 0.5, "staleness": 1.0}
BF16 = {**DCP_SETTINGS, "momentum_dtype": "bf16"}  # the momentum stored in bf16, stochastically rounded
OFFLOAD_CHECKPOINTS = {"offload": DCP_SETTINGS, "offload-bf16": BF16}  # (tag: settings) saved under CPUOffloadPolicy
# (layout, settings, step whose gradient gets a NaN on the last rank, -1 for none) per world size
CASES = {
    2: [
        ("fsdp", {"fraction": 0.5}, -1),
        ("fsdp", *STALENESS),
        ("fsdp", {"fraction": 1.0}, -1),
        ("fsdp", *SKIP),
        ("fsdp", *AUTO),
        ("fsdp", BF16, -1),
    ],
    4: [
        ("fsdp", {"fraction": 0.5}, -1),
        ("fsdp", *AUTO),
        ("fsdp", BF16, 1),
        ("hsdp", *STALENESS),
        ("hsdp", *SKIP),
        ("hsdp", *AUTO),
        ("hsdp", BF16, -1),
        ("tp", *STALENESS),
        ("tp", *SKIP),
        ("tp", *AUTO),
        ("tp", BF16, -1),
    ],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("dcp"))


@pytest.fixture(scope="module")
def two_ranks(checkpoint):
    return run_distributed(_two_rank_session, 2, checkpoint, timeout=300)


@pytest.fixture(scope="module")
def four_ranks(two_ranks, checkpoint):  # (after the two-rank session: it resumes its checkpoint)
    return run_distributed(_four_rank_session, 4, checkpoint, timeout=300)


@pytest.fixture(scope="module")
def one_rank(two_ranks, checkpoint):
    (out,) = run_distributed(_resumed_alone, 1, checkpoint, timeout=180)
    return out


@pytest.fixture(params=[2, 4], ids=["2-ranks", "4-ranks"])
def session(request):
    outs = request.getfixturevalue("two_ranks" if request.param == 2 else "four_ranks")
    return CASES[request.param], [out["cases"] for out in outs]


def test_dtensor_steps_equal_the_single_process_step(session):
    cases, outs = session
    for (layout, settings, bad_step), *per_rank in zip(cases, *outs):
        expected = _single_process(settings, bad_step)
        for out in per_rank:
            assert out["skipped"] == (bad_step >= 0), (layout, settings, bad_step)
            for name, value in out["params"].items():
                torch.testing.assert_close(value, expected[name], **TOL, msg=lambda m, n=name, c=(layout, settings): f"{c} {n}: {m}")


def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(session):
    cases, outs = session
    for case in [i for i, (_, _, bad_step) in enumerate(cases) if bad_step >= 0]:
        assert [per_rank[case]["skipped"] for per_rank in outs] == [1] * len(outs), cases[case]


def test_auto_fraction_is_chosen_alike_on_every_rank(session):
    cases, outs = session
    for case in [i for i, (_, settings, _) in enumerate(cases) if not settings]:
        chosen = [per_rank[case]["fractions"] for per_rank in outs]
        assert set(chosen[0]) == MATRICES, (cases[case], chosen)
        for c in chosen:  # a rank that holds no expert has no choice for them
            assert c == {k: v for k, v in chosen[0].items() if k in c} and set(chosen[0]) - set(c) <= {"experts"}, chosen


# FSDP2 with CPUOffloadPolicy: the weights' pieces and their gradients live in CPU memory, so does
# Dion3's state (made like each piece), and the step runs there. CPU processes cannot page-lock
# memory (that needs CUDA): they run the policy with pin_memory=False; the GPU test runs it as a
# GPU job does (a CUDA mesh, page-locked pieces, NCCL for FSDP2's collectives and gloo for the CPU
# tensors of Dion3's, as torchtitan's enable_cpu_offload sets up its process group).
OFFLOAD_CASES = [("offload", {"fraction": 0.5}, -1), ("offload", *STALENESS), ("offload", *SKIP), ("offload", BF16, -1)]


def _check_offloaded_runs(cases: list, outs: list[list[dict]], pinned: bool) -> None:
    """Every rank's run of each case equals the single-process step, with the weights, their
    gradients and Dion3's state in CPU memory (the weights page-locked where ``pinned``); a bf16
    momentum is the single process's."""
    held = {"weights": {"cpu"}, "gradients": {"cpu"}, "state": {"cpu"}, "pinned": pinned, "offloaded": True}
    for (layout, settings, bad_step), *per_rank in zip(cases, *outs):
        expected = _single_process(settings, bad_step)
        for out in per_rank:
            assert out["held"] == held, out["held"]
            assert out["skipped"] == (bad_step >= 0), (layout, settings, bad_step)
            for name, value in out["params"].items():
                torch.testing.assert_close(value, expected[name], **TOL, msg=lambda m, n=name, c=settings: f"{layout} {c} {n}: {m}")
            if settings.get("momentum_dtype") == "bf16":
                _assert_bf16_state_is_the_single_process_one(out["dion3 state"], _single_process_dion3_state(settings, bad_step), layout)


def test_fsdp2_with_cpu_offload_policy_steps_as_the_single_process_step(two_ranks):
    _check_offloaded_runs(OFFLOAD_CASES, [out["offload"] for out in two_ranks], pinned=False)


@pytest.mark.gpu
@pytest.mark.parametrize("streamed", [False, True], ids=["stepped-on-the-host", "streamed-through-the-gpu"])
def test_fsdp2_with_cpu_offload_policy_on_a_gpu_steps_as_the_single_process_step(streamed):
    """Dion3's step on the host, or with offload=True streamed through the GPU (the pieces, their
    gradients and the state copied there one shape group at a time, and back)."""
    cases = [("offload-cuda", {**settings, **({"offload": True} if streamed else {})}, bad_step) for _, settings, bad_step in OFFLOAD_CASES]
    (out,) = run_distributed(_session, 1, cases, timeout=300, backend="cuda:nccl,cpu:gloo")
    _check_offloaded_runs(cases, [out["cases"]], pinned=True)
    assert [run.get("streamed to") for run in out["cases"]] == ["cuda:0" if streamed else None] * len(cases)


def _pieces_in_cpu_memory_of_a_cuda_mesh(rank: int, world: int) -> dict:
    """DTensor parameters as FSDP2's CPUOffloadPolicy makes them on GPUs, on CPU processes: a mesh
    whose device type is CUDA (its process group gloo) and each rank's row piece in CPU memory.
    Three steps of the same gradients on every rank: this rank's pieces of the weight and of its
    Dion3 state, and where that state lies."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from dion3_megatron import Dion3

    mesh = DeviceMesh("cpu", torch.arange(world))
    mesh._device_type = "cuda"  # what a GPU job's mesh says, its pieces left where they are

    def piece(whole: torch.Tensor) -> DTensor:
        spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(whole.shape, whole.stride(), whole.dtype))
        return DTensor(whole.chunk(world)[rank].clone(), spec, requires_grad=False)

    start, grads = _offload_steps()
    p = torch.nn.Parameter(piece(start))
    opt = Dion3([("w", p)], lr=0.05, fraction=0.5, staleness=1.0, ns_dtype=torch.float64)
    for grad in grads:
        p.grad = piece(grad)
        opt.step()
    state = {part: v.to_local() for part, v in opt.state[p].items()}
    return {
        "param": p.to_local().detach().clone(),
        **{part: v.clone() for part, v in state.items()},
        "devices": {v.device.type for v in state.values()},
    }


def _stepped_whole(name: str, start: torch.Tensor, grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One process's steps of the whole parameter (f = 1/2, staleness): the weight and its state after them."""
    from dion3_megatron import Dion3

    p = torch.nn.Parameter(start.clone())
    opt = Dion3([(name, p)], lr=0.05, fraction=0.5, staleness=1.0, ns_dtype=torch.float64)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    return {"param": p.detach(), **opt.state[p]}


def _offload_steps() -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(7, 5, generator=gen), [torch.randn(7, 5, generator=gen) for _ in range(STEPS)]


def test_pieces_in_cpu_memory_of_a_cuda_mesh_keep_their_state_there(two_ranks):
    """The state DTensors are the engine's buffers where the pieces lie: not copies on the mesh's
    device type (which ``DTensor.from_local`` makes), which the step would never update."""
    whole = _stepped_whole("w", *_offload_steps())
    for rank, held in enumerate(per_rank["pieces in cpu memory"] for per_rank in two_ranks):
        out = dict(held)  # (the fixture's, shared)
        assert out.pop("devices") == {"cpu"}
        for part, value in out.items():
            expected = whole[part].chunk(2, dim=0 if part in ("param", "momentum") else 1)[rank]
            torch.testing.assert_close(value, expected, **TOL, msg=lambda m, q=part, r=rank: f"rank {r} {q}: {m}")


def _dcp_worker(rank: int, world: int, layout: str, directory: Optional[str], steps: range, settings: dict) -> dict:
    """Steps ``steps`` of the batches; saves through torch.distributed.checkpoint after them in
    ``directory`` (None: no save) when they start at 0, else first loads what a run at another world
    size or layout saved: the parameters and the Dion3 state after them, where the pieces and the
    state lie and whether the Dion3 state is page-locked (and the Dion3 state as loaded, and where
    it lay then)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = _sharded(world, layout, settings)
    out = {}
    if steps.start:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=directory)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        out["loaded"], out["held after the load"] = _dion3_state(model, opt), _held_where(model, opt)
    device = model.up.weight.device_mesh.device_type  # where the forward runs: the mesh's device
    for x in _batches()[steps.start : steps.stop]:
        opt.zero_grad()
        model(x.to(device)).square().mean().backward()
        opt.step()
    if not steps.start and directory is not None:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=directory)
    return {
        **out,
        "params": {n: p.detach().full_tensor().cpu().clone() for n, p in model.named_parameters()},
        "dion3 state": _dion3_state(model, opt),
        "held": _held_where(model, opt),
        "state pinned": _dion3_state_pinned(model, opt),
        **({"streamed to": str(opt._whole.session.engine.offload)} if settings.get("offload") else {}),
    }


def _dion3_state_pinned(model: torch.nn.Module, opt) -> bool:
    """Whether this rank's pieces of every Dion3 matrix's state are page-locked."""
    from dion3_megatron.frontend.dtensor import local

    return all(local(v).is_pinned() for n, p in model.named_parameters() if n in MATRICES for v in opt.state[p].values())


def test_a_checkpoint_saved_at_two_ranks_resumes_at_one_and_at_four_with_tensor_parallelism(one_rank, four_ranks):
    expected = _single_process(DCP_SETTINGS, bad_step=-1)
    resumed = {(1, "fsdp"): [one_rank["fp32"]], (4, "tp"): [out["resumed"] for out in four_ranks]}
    for (world, layout), outs in resumed.items():  # (saved after two steps by the two-rank session)
        for out in outs:
            for name, value in out["params"].items():
                torch.testing.assert_close(
                    value, expected[name], **TOL, msg=lambda m, n=name, w=world, lay=layout: f"{lay} at {w} ranks {n}: {m}"
                )


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps (of the larger magnitude) two bf16 tensors differ by, entry by entry."""
    spacing = torch.maximum(a.float().abs(), b.float().abs()) * 2.0**-7
    return (a.float() - b.float()).abs() / spacing.clamp_min(torch.finfo(torch.float32).tiny)


def _assert_bf16_state_is_the_single_process_one(state: dict, expected: dict, what: str) -> None:
    """A DTensor run's Dion3 state (``_dion3_state``, gathered whole) against one process's on the
    whole matrices: the momentum in bf16, its count of steps (``rounding_step``) one per matrix, the
    same, replicated, or for the 3-D experts cut like them; the momentum the single process's bit
    for bit but for an entry whose fp32 sum lay so near a rounding boundary that the fp32 rounding
    of the distributed gradients, or of a GPU's forward and backward, put it across (at most one
    entry, or 1 in 1000 of a larger matrix, by one bf16 step). Noise keyed by the place in a rank's
    piece instead of in the logical matrix leaves most entries apart (86-92 % after three steps at
    two ranks)."""
    assert state.keys() == {n for n in expected if n in MATRICES}, what
    for name, parts in state.items():
        assert parts.keys() == {"momentum", "variance", "row_age", "rounding_step"}, (what, name)
        counts, placements = parts["rounding_step"]
        assert counts.dtype == torch.int64 and torch.equal(counts, expected[name]["rounding_step"]), (what, name, counts)
        split = [pl for pl in placements if pl != Replicate()]
        assert split == ([Shard(0)] if name == "experts" else []), (what, name, placements)
        momentum = parts["momentum"][0]
        assert momentum.dtype == torch.bfloat16, (what, name)
        apart = _bf16_steps(momentum, expected[name]["momentum"])
        assert (apart > 0).sum() <= max(1, 1e-3 * apart.numel()) and apart.max() <= 1, (what, name, (apart > 0).sum().item())
        for part in ("variance", "row_age"):
            torch.testing.assert_close(parts[part][0], expected[name][part], **TOL, msg=lambda m, q=part: f"{what} {name} {q}: {m}")


def _single_process_dion3_state(settings: dict, bad_step: int) -> dict:
    model, opt = _single_process_run(settings, bad_step)
    return {n: opt.state[p] for n, p in model.named_parameters() if n in MATRICES}


def test_a_bf16_momentum_of_dtensor_parameters_is_the_single_process_one(session):
    cases, outs = session
    bf16 = [i for i, (_, settings, _) in enumerate(cases) if settings.get("momentum_dtype") == "bf16"]
    assert {cases[i][0] for i in bf16} == ({"fsdp"} if len(outs) == 2 else {"fsdp", "hsdp", "tp"})
    for i in bf16:
        layout, settings, bad_step = cases[i]
        expected = _single_process_dion3_state(settings, bad_step)
        assert {n: s["rounding_step"].tolist() for n, s in expected.items()} == {
            n: [STEPS - (bad_step >= 0)] * (3 if n == "experts" else 1) for n in MATRICES
        }
        for rank, per_rank in enumerate(outs):
            _assert_bf16_state_is_the_single_process_one(per_rank[i]["dion3 state"], expected, f"{layout} rank {rank}")


def test_a_bf16_momentum_checkpoint_resumes_bit_identically_at_two_ranks_and_at_one(two_ranks, one_rank, checkpoint):
    """Saved at two ranks (experts 2/1) through torch.distributed.checkpoint, which keeps the
    momentum in bf16 and each matrix's count of steps once (the experts' three counts as one
    tensor): resumed at two ranks it is the uninterrupted run bit for bit, weights and state;
    resumed at one it loads the state as saved, bit for bit, and steps as the single process."""
    import torch.distributed.checkpoint as dcp

    directory = checkpoint + "-bf16"
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    for name in MATRICES:
        counts, momentum = saved[f"optim.state.{name}.rounding_step"], saved[f"optim.state.{name}.momentum"]
        assert counts.size == (3 if name == "experts" else 1,) and counts.properties.dtype == torch.int64, (name, counts)
        assert momentum.properties.dtype == torch.bfloat16, (name, momentum)
    (uninterrupted,) = [i for i, (_, settings, _) in enumerate(CASES[2]) if settings == BF16]
    for rank, out in enumerate(per_rank["bf16 resumed"] for per_rank in two_ranks):
        went_on = two_ranks[rank]["cases"][uninterrupted]
        for name, value in out["params"].items():
            assert torch.equal(value, went_on["params"][name]), (rank, name)
        for name, parts in out["dion3 state"].items():
            for part, (value, placements) in parts.items():
                assert torch.equal(value, went_on["dion3 state"][name][part][0]), (rank, name, part)
        at_two = {n: {part: v for part, (v, _) in parts.items()} for n, parts in out["loaded"].items()}
    alone = one_rank["bf16"]
    for name, parts in alone["loaded"].items():
        for part, (value, _) in parts.items():
            assert torch.equal(value, at_two[name][part]), (name, part)
    expected = _single_process(BF16, bad_step=-1)
    for name, value in alone["params"].items():
        torch.testing.assert_close(value, expected[name], **TOL, msg=lambda m, n=name: f"resumed at 1 rank {n}: {m}")
    _assert_bf16_state_is_the_single_process_one(alone["dion3 state"], _single_process_dion3_state(BF16, -1), "resumed at 1 rank")


def test_a_checkpoint_under_cpu_offload_policy_resumes_exactly_under_it_and_without_it(two_ranks, one_rank):
    """Saved at two ranks under CPUOffloadPolicy through torch.distributed.checkpoint, fp32 and bf16
    momentum: resumed at two ranks under the policy the state loads into CPU memory and the run is
    the uninterrupted one bit for bit, weights and state; resumed at one rank without the policy
    (the checkpoint holds no placement) it loads the state as saved and steps as the single process."""
    held = {"weights": {"cpu"}, "state": {"cpu"}, "pinned": False, "offloaded": True}
    for tag, settings in OFFLOAD_CHECKPOINTS.items():
        expected = _single_process(settings, bad_step=-1)
        for rank, per_rank in enumerate(two_ranks):
            resumed, went_on = per_rank[f"{tag} resumed"], per_rank[f"{tag} uninterrupted"]
            assert resumed["held after the load"] == {**held, "gradients": set()}, (tag, rank, resumed["held after the load"])
            assert resumed["held"] == went_on["held"] == {**held, "gradients": {"cpu"}}, (tag, rank, resumed["held"])
            for name, value in resumed["params"].items():
                assert torch.equal(value, went_on["params"][name]), (tag, rank, name)
                torch.testing.assert_close(value, expected[name], **TOL, msg=lambda m, n=name, t=tag: f"{t} at 2 ranks {n}: {m}")
            assert resumed["dion3 state"].keys() == went_on["dion3 state"].keys() == MATRICES, tag
            for name, parts in resumed["dion3 state"].items():
                assert parts.keys() == went_on["dion3 state"][name].keys(), (tag, name)
                for part, (value, placements) in parts.items():
                    value_on, placements_on = went_on["dion3 state"][name][part]
                    assert torch.equal(value, value_on) and placements == placements_on, (tag, rank, name, part)
        alone, at_two = one_rank[tag], two_ranks[0][f"{tag} resumed"]
        assert alone["held after the load"] == {**held, "gradients": set(), "offloaded": False}, (tag, alone["held after the load"])
        assert alone["loaded"].keys() == at_two["loaded"].keys() == MATRICES, tag
        for name, parts in alone["loaded"].items():
            for part, (value, _) in parts.items():
                assert torch.equal(value, at_two["loaded"][name][part][0]), (tag, name, part)
        for name, value in alone["params"].items():
            torch.testing.assert_close(value, expected[name], **TOL, msg=lambda m, n=name, t=tag: f"{t} at 1 rank {n}: {m}")


@pytest.mark.gpu
def test_a_checkpoint_under_cpu_offload_policy_on_a_gpu_resumes_as_the_single_process(tmp_path):
    """One GPU, the pieces page-locked, Dion3's step streamed through the GPU (offload=True): saved
    after two steps, loaded by a fresh process into CPU memory, the last step equals the single
    process's, the state in page-locked CPU memory after it."""
    settings, directory = {**DCP_SETTINGS, "offload": True}, str(tmp_path / "dcp")
    backend = "cuda:nccl,cpu:gloo"
    run_distributed(_dcp_worker, 1, "offload-cuda", directory, range(0, 2), settings, timeout=300, backend=backend)
    (out,) = run_distributed(_dcp_worker, 1, "offload-cuda", directory, range(2, STEPS), settings, timeout=300, backend=backend)
    held = {"weights": {"cpu"}, "state": {"cpu"}, "pinned": True, "offloaded": True}
    assert out["held after the load"] == {**held, "gradients": set()}, out["held after the load"]
    assert out["held"] == {**held, "gradients": {"cpu"}} and out["state pinned"], (out["held"], out["state pinned"])
    assert out["streamed to"] == "cuda:0"
    expected = _single_process(DCP_SETTINGS, bad_step=-1)
    for name, value in out["params"].items():
        torch.testing.assert_close(value, expected[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


class _AutoNet(torch.nn.Module):
    """Matrices of 512 rows, where a FLOP-bound device chooses f < 1, and three such experts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(64, 512), torch.nn.Linear(512, 64)
        self.experts = torch.nn.Parameter(0.05 * torch.randn(3, 512, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x) + torch.einsum("bi,eoi->bo", x, self.experts)))


def _auto_resumed(world: int, directory: str) -> tuple[dict, dict]:
    """fraction="auto" chosen where the device is FLOP-bound (small f on these 512-row matrices),
    saved through torch.distributed.checkpoint and loaded where it is launch-bound (it would choose
    f = 1): the record of the choices (by matrix name, experts held on other ranks included) before
    and after the resume."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dion3_megatron import Dion3
    from dion3_megatron.core import cost_model
    from dion3_megatron.core.cost_model import DeviceSpeed
    from dion3_megatron.engine import fractions

    def built():
        model = _AutoNet()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # the experts 2/1 at 2 ranks
        return model, Dion3(model.named_parameters(), ns_dtype=torch.float32)

    def record(opt) -> dict:
        return {name: f for group in opt.state_dict()["param_groups"] for name, f in group["fractions"].items()}

    measured, tokens = fractions.measure, cost_model.TOKENS_PER_STEP
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    try:
        cost_model.TOKENS_PER_STEP = 0  # the optimizer's step is the whole iteration
        fractions.measure = lambda device, dtype: DeviceSpeed(1e6, 0.0, 1e30, 1e30)
        model, opt = built()
        model(x).square().mean().backward()
        opt.step()
        saved = record(opt)
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=directory)
        fractions.measure = lambda device, dtype: DeviceSpeed(1e30, 1.0, 1e30, 1e30)
        model, opt = built()
        state = {"optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=directory)
        set_optimizer_state_dict(model, opt, state["optim"])
        model(x).square().mean().backward()
        opt.step()
        return saved, record(opt)
    finally:
        fractions.measure, cost_model.TOKENS_PER_STEP = measured, tokens


def test_a_checkpoint_keeps_the_automatic_fractions_chosen(two_ranks):
    matrices = {"up.weight", "down.weight", "experts.matrix0", "experts.matrix1", "experts.matrix2"}
    for saved, resumed in (out["auto resumed"] for out in two_ranks):  # each rank's record
        assert set(saved) == matrices and saved["experts.matrix2"] < 1 and resumed == saved, (saved, resumed)


def _refusals(world: int) -> list[str]:
    """Placements the engine does not take: refused when the optimizer is given them, naming the
    parameter; a gradient placed unlike its parameter, and a piece unlike its placements: at the
    step, with nothing changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from dion3_megatron import Dion3

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(2)
    cases = {
        "partial": DTensor.from_local(torch.randn(8, 4, generator=gen), mesh, [Partial()]),
        "conv": distribute_tensor(torch.randn(8, 2, 3, 3, generator=gen), mesh, [Shard(0)]),
        # rows cut left to right, then strided: rank 0 would hold rows 0 and 2, not a block
        "strided rows": DTensor.from_local(
            torch.randn(2, 4, generator=gen),
            init_device_mesh("cpu", (1, world)),
            [Shard(0), _StridedShard(0, split_factor=2)],
            run_check=False,
            shape=(2 * world, 4),
            stride=(4, 1),
        ),
    }
    messages = []
    for name, value in cases.items():
        with pytest.raises(ValueError) as error:
            Dion3([(name, torch.nn.Parameter(value))], ns_dtype=torch.float32)
        messages.append(str(error.value))
    weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4, generator=gen), mesh, [Shard(0)]))
    weight.grad = distribute_tensor(torch.randn(8, 4, generator=gen), mesh, [Replicate()])
    before = weight.detach().to_local().clone()
    opt = Dion3([("replicated grad", weight)], ns_dtype=torch.float32)
    with pytest.raises(ValueError) as error:
        opt.step()
    assert torch.equal(weight.detach().to_local(), before) and not opt.state[weight]
    messages.append(str(error.value))
    short = torch.nn.Parameter(
        DTensor.from_local(torch.randn(3, 4, generator=gen), mesh, [Shard(0)], run_check=False, shape=(4 * world, 4), stride=(4, 1))
    )  # 3 of its 4 rows
    short.grad = DTensor.from_local(
        torch.randn(3, 4, generator=gen), mesh, [Shard(0)], run_check=False, shape=(4 * world, 4), stride=(4, 1)
    )
    opt = Dion3([("short piece", short)], ns_dtype=torch.float32)
    with pytest.raises(ValueError) as error:
        opt.step()
    assert not opt.state[short]
    return messages + [str(error.value)]


def test_placements_the_engine_does_not_take_are_refused_naming_the_parameter(two_ranks):
    for partial, conv, strided, grad, short in (out["refused"] for out in two_ranks):
        assert partial.startswith("partial: Dion3 takes DTensor parameters placed by Shard") and "Partial" in partial
        assert conv.startswith("conv: Dion3 takes 2-D DTensor matrices and 3-D ones (a batch of matrices"), conv
        assert strided.startswith("strided rows: dimension 0 is cut into pieces that are not contiguous"), strided
        assert grad.startswith("replicated grad: its gradient is placed (Replicate(),), not like the parameter"), grad
        assert short.startswith("short piece: this rank holds (3, 4), not the (4, 4) its placements give"), short


def _experts_split_inside(world: int) -> dict[str, dict[str, torch.Tensor]]:
    """3-D parameters (3 experts of 7 x 5) split inside their matrices, by rows (Shard(1): 4/3 rows
    at 2 ranks) and by columns (Shard(2): 3/2), three steps of the same gradients on every rank:
    the whole parameters and their Dion3 state (momentum, variance, row ages) after them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dion3_megatron import Dion3

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(3, 7, 5, generator=gen)
    grads = [torch.randn(3, 7, 5, generator=gen) for _ in range(STEPS)]
    out = {}
    for name, dim in (("expert rows", 1), ("expert columns", 2)):
        p = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(dim)]))
        opt = Dion3([(name, p)], lr=0.05, fraction=0.5, staleness=1.0, ns_dtype=torch.float64)
        for grad in grads:
            p.grad = distribute_tensor(grad, mesh, [Shard(dim)])
            opt.step()
        state = {part: v.full_tensor() for part, v in opt.state[p].items()}
        out[name] = {"param": p.detach().full_tensor(), **state}
    return out


def test_a_3d_parameter_split_inside_its_matrices_steps_as_the_single_process_step(two_ranks):
    """Each local expert is a row or column piece of its matrix over the same ranks: the step, and
    the state as the ranks place it (gathered whole), equal one process stepping whole experts."""
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(3, 7, 5, generator=gen)
    expected = _stepped_whole("experts", start, [torch.randn(3, 7, 5, generator=gen) for _ in range(STEPS)])
    assert set(expected) == {"param", "momentum", "variance", "row_age"}
    assert (expected["param"] - start).abs().max() > 1e-2  # the steps moved it
    for out in two_ranks:
        for name, held in out["split experts"].items():
            assert held.keys() == expected.keys(), name
            for part, value in held.items():
                torch.testing.assert_close(value, expected[part], **TOL, msg=lambda m, n=name, q=part: f"{n} {q}: {m}")


def test_the_fsdp2_example_trains_with_tensor_parallelism_on_two_cpu_processes():
    # (the plain FSDP2 command of docs/fsdp2.md runs in the docs' command test)
    example = ROOT / "examples" / "fsdp2_train.py"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(example),
            "--steps",
            "20",
            "--context",
            "32",
            "--tp",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+  loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0] - 1.0, run.stdout
    assert "tensor parallelism 2 inside FSDP2 over 1 ranks" in run.stdout, run.stdout
    assert "skipped steps 0" in run.stdout and "fraction=auto chose (shape: f) 128x128: " in run.stdout, run.stdout


def _held(model: torch.nn.Module, opt) -> dict[str, torch.Tensor]:
    """Copies of every tensor this rank holds of the weights and the optimizer's state."""
    from dion3_megatron.frontend.dtensor import local

    names = {p: n for n, p in model.named_parameters()}
    held = {n: local(p).detach().clone() for n, p in model.named_parameters()}
    held.update({f"{names[p]} {k}": local(v).detach().clone() for p, s in opt.state.items() for k, v in s.items()})
    return held


def _refused_step(model: torch.nn.Module, opt) -> tuple[str, str, list[str]]:
    """The step's error (type and message) and what it changed of the tensors this rank holds."""
    before = _held(model, opt)
    with pytest.raises(Exception) as error:
        opt.step()
    after = _held(model, opt)
    changed = [n for n in before.keys() | after.keys() if n not in before or n not in after or not torch.equal(before[n], after[n])]
    return type(error.value).__name__, str(error.value), changed


def _gradient_changed_at_a_later_step(rank: int, world: int) -> dict:
    """Two steps, then at the third the last rank's gradient of one parameter placed unlike it
    (replicated, or a piece of another shape): every rank's step is refused and changes nothing;
    then the third step with the right gradients."""
    from torch.distributed.tensor import DTensor, Replicate

    model, opt = _sharded(world, "fsdp", {"fraction": 0.5})
    batches = _batches()
    for x in batches[:2]:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    opt.zero_grad()
    model(batches[2]).square().mean().backward()
    refused = {}
    for name, change in (("up.weight", "replicated"), ("up.weight", "rows"), ("up.bias", "replicated")):
        p = model.get_parameter(name)
        grad = p.grad
        if rank == world - 1:
            values = torch.randn(p.shape) if change == "replicated" else torch.randn(1, *p.shape[1:])
            placements = [Replicate()] if change == "replicated" else p.placements
            p.grad = DTensor.from_local(values, p.device_mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
        refused[name, change] = _refused_step(model, opt)
        p.grad = grad
    opt.step()
    return {
        "refused": refused,
        "skipped": opt.skipped_steps,
        "params": {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()},
    }


def test_a_gradient_placed_unlike_its_parameter_at_a_later_step_is_refused_on_every_rank(two_ranks):
    outs = [out["gradient changed"] for out in two_ranks]
    expected = _single_process({"fraction": 0.5}, bad_step=-1)
    for rank, out in enumerate(outs):
        for (name, change), (kind, message, changed) in out["refused"].items():
            assert not changed, (rank, name, change, changed)
            if rank == 1:
                assert kind == "ValueError" and message.startswith(f"{name}: its gradient"), (name, change, message)
            else:
                assert kind == "StepRefused" and "rank(s) [1]" in message, (name, change, message)
                assert f"Rank 1: ValueError: {name}: its gradient" in message, (name, change, message)
        assert out["skipped"] == 0
        for name, value in out["params"].items():  # the refusals left the run as it was
            torch.testing.assert_close(value, expected[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _outside_the_mesh(rank: int, world: int) -> tuple[str, str]:
    """A parameter on a mesh of rank 0 alone and one on the world's mesh: the step's error."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dion3_megatron import Dion3

    gen = torch.Generator().manual_seed(4)
    alone, everyone = DeviceMesh("cpu", [0]), init_device_mesh("cpu", (world,))
    params = {
        "alone": torch.nn.Parameter(distribute_tensor(torch.randn(8, 4, generator=gen), alone, [Shard(0)])),
        "shared": torch.nn.Parameter(distribute_tensor(torch.randn(8, 4, generator=gen), everyone, [Shard(0)])),
    }
    for p in params.values():
        p.grad = distribute_tensor(torch.randn(8, 4, generator=gen), p.device_mesh, [Shard(0)])
    opt = Dion3(list(params.items()), ns_dtype=torch.float32)
    with pytest.raises(Exception) as error:
        opt.step()
    return type(error.value).__name__, str(error.value)


def test_a_parameter_on_a_mesh_without_this_rank_is_refused_on_every_rank(two_ranks):
    (kind0, message0), (kind1, message1) = (out["outside the mesh"] for out in two_ranks)
    assert kind0 == "StepRefused" and "rank(s) [1]" in message0, message0
    assert "Rank 1: ValueError: alone: " in message0, message0  # rank 0's log names the parameter and why
    assert kind1 == "ValueError" and message1.startswith("alone: ") and "[0]" in message1, message1
