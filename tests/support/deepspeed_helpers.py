"""DeepSpeed on CPU for the tests: gloo, no op builds, a tiny model whose matrices straddle ZeRO slices.

The session functions run in spawned workers (support.dist_utils.run_distributed). Importing this
module changes nothing: the environment (DS_ACCELERATOR=cpu, no torch.compile) is set and
DeepSpeed imported by :func:`init`, in the worker, so the pytest process and the other tests'
workers never see it.
"""

from __future__ import annotations

import importlib
import glob
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

deepspeed: Any = None
dion3_ds: Any = None
dion3_ckpt: Any = None


def import_keeping_environment(name: str):
    """Import a module in the pytest process without letting it change os.environ.

    ``import deepspeed`` sets PYTORCH_NVML_BASED_CUDA_CHECK=1, which processes spawned later by
    other tests inherit (their torch.compile then probes CUDA and fails on a machine without it).
    """
    saved = dict(os.environ)
    try:
        return importlib.import_module(name)
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


VOCAB, WIDTH, HIDDEN, EXPERTS, EXPERT_ROWS, SEQ = 13, 12, 20, 3, 8, 5
GLOBAL_BATCH = 4


class Net(torch.nn.Module):
    """~1.3k parameters in odd shapes: on 2 or 4 ranks most matrices straddle ZeRO slices."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(EXPERTS, EXPERT_ROWS, WIDTH) * 0.3)  # a batch of matrices
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        e = torch.einsum("btd,end->bten", h, self.experts)
        h = h + torch.einsum("bten,end->btd", torch.tanh(e), self.experts) / EXPERTS
        logits = self.head(self.norm(h)).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())


class MoENet(Net):
    """Net plus a DeepSpeed MoE layer: expert parameters live in an expert-data-parallel group."""

    def __init__(self, ep_size: int = 2) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        expert = torch.nn.Sequential(torch.nn.Linear(WIDTH, 16, bias=False), torch.nn.GELU(), torch.nn.Linear(16, WIDTH, bias=False))
        self.moe = MoE(
            hidden_size=WIDTH,
            expert=expert,
            num_experts=4,
            ep_size=ep_size,
            k=1,
            capacity_factor=8.0,
            min_capacity=0,
            drop_tokens=False,
            use_rts=False,
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        out, aux, _ = self.moe(h)
        logits = self.head(self.norm(h + out)).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten()) + 0.01 * aux


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, the gradient summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: the partial outputs summed over the tensor-parallel group, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelNet(torch.nn.Module):
    """A Megatron-style MLP over a tensor-parallel group: fc1 column-parallel (row blocks,
    ``partition_dim`` 0), fc2 row-parallel (column blocks, ``partition_dim`` 1); embedding, norm
    and head replicated. ``tp=1`` is the same model unsharded (the same weights for a seed)."""

    def __init__(self, tp: int = 1, tp_rank: int = 0, group=None) -> None:
        super().__init__()
        self.group, self.tp = group, tp
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH, bias=False)  # replicated: ZeRO's cut then falls inside fc1
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        fc1, fc2 = torch.randn(HIDDEN, WIDTH) * 0.3, torch.randn(WIDTH, HIDDEN) * 0.3
        self.fc1 = torch.nn.Parameter(fc1.chunk(tp, 0)[tp_rank].clone())
        self.fc2 = torch.nn.Parameter(fc2.chunk(tp, 1)[tp_rank].contiguous())
        if tp > 1:
            for p, dim in ((self.fc1, 0), (self.fc2, 1)):
                p.tensor_model_parallel, p.partition_dim = True, dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + torch.tanh(self.mix(h))
        x = _CopyToTensorParallel.apply(h, self.group) if self.tp > 1 else h
        y = torch.nn.functional.gelu(x @ self.fc1.T) @ self.fc2.T
        y = _ReduceFromTensorParallel.apply(y, self.group) if self.tp > 1 else y
        logits = self.head(self.norm(h + y)).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())


class TensorParallelMPU:
    """The Megatron-style ``mpu`` DeepSpeed takes: TP groups of consecutive ranks, data parallel across."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp = tp
        tp_groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
        dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
        self.tp_group, self.dp_group = tp_groups[rank // tp], dp_groups[rank % tp]

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank() % self.tp

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank() // self.tp

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size() // self.tp

    def get_data_parallel_group(self):
        return self.dp_group


def tensor_parallel_vs_single_process(stage: int, tp: int = 2, steps: int = 3, bf16: bool = False) -> dict:
    """TensorParallelNet under ZeRO ``stage`` with TP=tp (mpu) against the unsharded model stepped by
    the single-process optimizer (fp32) on the same global batches: the worst difference, and the
    pieces. ``bf16``: the model in bf16 under DeepSpeed's BF16_Optimizer (fp32 accumulation)."""
    mpu = TensorParallelMPU(tp)
    dp, dp_rank, tp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank(), mpu.get_model_parallel_rank()
    cfg = config(stage, world=dp, clip=0.0)
    if bf16:
        cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    torch.manual_seed(0)
    model = TensorParallelNet(tp, tp_rank, mpu.tp_group)
    if bf16:
        model = model.to(torch.bfloat16)
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=dion3_ds.param_groups(model), config=cfg, mpu=mpu)
    torch.manual_seed(0)
    reference = TensorParallelNet()
    from dion3_megatron.deepspeed.optimizer import DeepSpeedDion3

    reference_opt = DeepSpeedDion3(dion3_ds.param_groups(reference), **cfg["optimizer"]["params"])
    per = GLOBAL_BATCH // dp
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(tokens[dp_rank * per : (dp_rank + 1) * per]))
        engine.step()
        reference_opt.zero_grad()
        reference(tokens).backward()
        reference_opt.step()
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    expected["fc1"] = expected["fc1"].chunk(tp, 0)[tp_rank]
    expected["fc2"] = expected["fc2"].chunk(tp, 1)[tp_rank]
    got = params_of(engine)
    pieces = [
        piece for plan in partition_plans(engine) for piece in plan.pieces if piece.shard.sharding.kind != "full"
    ]  # (the replicated mix lies whole in one slice)
    kinds = sorted({piece.shard.sharding.kind for piece in pieces})
    # Slices cut inside a TP block (the rest of the block on the other data-parallel rank).
    inside = sum(0 < piece.length < piece.shard.sharding.bounds[-1] for piece in pieces)
    return {
        "diff": max_diff(got, expected),
        "piece_kinds": kinds,
        "cut_inside_a_block": inside,
        "moved": min((got[n] - initial[n]).abs().max().item() for n in ("fc1", "fc2")),
    }


def tensor_parallel_without_zero_warns(tp: int = 2) -> bool:
    """Stage 0 steps each TP block as a matrix of its own: one step must say so."""
    import warnings

    from dion3_megatron.deepspeed import zero

    zero._WARNED_TP = False  # once per process: the single-process references above may have said it
    mpu = TensorParallelMPU(tp)
    torch.manual_seed(0)
    model = TensorParallelNet(tp, mpu.get_model_parallel_rank(), mpu.tp_group)
    cfg = config(0, world=mpu.get_data_parallel_world_size(), clip=0.0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=dion3_ds.param_groups(model), config=cfg, mpu=mpu)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH // mpu.get_data_parallel_world_size(), SEQ), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.backward(engine(tokens))
        engine.step()
    return any("matrix of its own" in str(w.message) for w in caught)


def init() -> None:
    """In a worker: CPU accelerator, DeepSpeed and Dion3's registration, gloo comms."""
    global deepspeed, dion3_ds, dion3_ckpt
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import deepspeed as _deepspeed

    # Starting comms would compile a C++ shared-memory op (90-150 s): not needed with gloo.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import dion3_megatron.deepspeed as _dion3_ds
    from dion3_megatron.deepspeed import checkpoint as _dion3_ckpt

    deepspeed, dion3_ds, dion3_ckpt = _deepspeed, _dion3_ds, _dion3_ckpt
    deepspeed.init_distributed(dist_backend="gloo")


def config(stage: int, ga: int = 1, clip: float = 0.5, dtype: str = "fp32", world: int = 2, **params: Any) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        # f = 1/2 steps at 2 lr (scale_lr_by_fraction): 0.02, and adamw_lr as much, so that the few
        # steps of these runs move the AdamW tensors visibly too
        "optimizer": {"type": "Dion3", "params": {"lr": 0.01, "adamw_lr": 0.02, "fraction": 0.5, "ns_dtype": "float64", **params}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def make_engine(cfg: dict, groups: bool = False, seed: int = 0, model_class=None):
    torch.manual_seed(seed)
    model = (model_class or Net)()
    if cfg.get("bf16", {}).get("enabled"):
        model = model.to(torch.bfloat16)
    params = dion3_ds.param_groups(model) if groups else model.parameters()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def batch(step: int, micro: int, world: int) -> torch.Tensor:
    """This rank's micro batch: the same global batch whatever the world size."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    per = GLOBAL_BATCH // world
    rank = dist.get_rank()
    return tokens[rank * per : (rank + 1) * per]


def train(engine, steps: int, start: int = 0, fixed: bool = False) -> dict:
    """``steps`` optimizer steps on the batches of steps start, start + 1, ... (or always step 0's)."""
    world = dist.get_world_size()
    ga = engine.gradient_accumulation_steps()
    losses, norms = [], []
    for step in range(start, start + steps):
        for micro in range(ga):
            loss = engine(batch(0 if fixed else step, micro, world))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm() or 0.0))
    return {"losses": losses, "norms": norms}


def params_of(engine) -> dict[str, torch.Tensor]:
    """The model's parameters, whole (gathered from every rank under ZeRO-3: collective)."""
    params = list(engine.module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        with deepspeed.zero.GatheredParameters(params):
            return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def init_error(cfg: dict) -> Optional[str]:
    """The message deepspeed.initialize fails with, or None."""
    try:
        make_engine(cfg)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------
# Sessions: one process group, many checks (DeepSpeed start-up dominates a tiny model's cost).


def _basic(engine):
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def partition_plans(engine) -> list:
    """What each ZeRO partition this rank steps holds (:class:`dion3_megatron.deepspeed.zero.PartitionPlan`)."""
    return _basic(engine)._step_plan.partitions


def inject_nan_once(engine, rank: int, partition: int) -> None:
    """At the next ZeRO step, a NaN in the gradient of this rank's partition ``partition`` when it is
    handed to Dion3 on rank ``rank`` (after DeepSpeed's own checks, which saw finite gradients)."""
    basic = _basic(engine)
    target = basic._partitions[partition].flat
    step = basic.step

    def step_with_nan(*args, **kwargs):
        handed = [p for g in basic.param_groups for p in g["params"]]
        if any(p is target for p in handed):
            if dist.get_rank() == rank:
                target.grad[0] = float("nan")
            basic.step = step
        return step(*args, **kwargs)

    basic.step = step_with_nan


def _refused_on_one_rank(engine) -> dict:
    """A setting made invalid on rank 0 only: the step raises on every rank (rank 0 its own error,
    the others naming rank 0), and nothing changes anywhere."""
    train(engine, 1)
    before = params_of(engine)
    basic = _basic(engine)
    if dist.get_rank() == 0:
        basic.param_groups[1]["lr"] = -1.0
    try:
        train(engine, 1, start=5)
        error = None
    except Exception as e:  # noqa: BLE001 - the test reports what was raised
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "change": max_diff(before, params_of(engine))}


def nan_in_one_partition(engine, partition: int) -> dict:
    """A finite step, then one with a NaN in one partition on rank 0 only: Dion3 skips it on every
    rank (one count), no weight or state changes; the next step is taken."""
    train(engine, 1)
    basic = _basic(engine)
    before = params_of(engine)
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in basic.state.items()}
    skipped = basic.skipped_steps
    inject_nan_once(engine, 0, partition)
    train(engine, 1, start=5)
    state_change = max((v - state[id(p)][k]).abs().max().item() for p, s in basic.state.items() for k, v in s.items())
    out = {
        "partitions": len(basic._partitions),
        "skipped": basic.skipped_steps - skipped,
        "change": max_diff(before, params_of(engine)),
        "state_change": state_change,
        "deepspeed_skipped": engine.skipped_steps,
    }
    train(engine, 1, start=6)
    out["then_moved"] = max_diff(before, params_of(engine))
    return out


def _state_vs_stage0(zero_engine, stage0_engine) -> dict:
    """Full ZeRO slice state of every matrix vs stage 0's per-parameter Dion3 state."""
    from deepspeed.utils import safe_get_full_optimizer_state

    ref = _basic(stage0_engine)
    momentum_diff = variance_diff = row_spread = adamw_diff = 0.0
    for (name, p), p0 in zip(zero_engine.module.named_parameters(), stage0_engine.module.parameters()):
        s0 = ref.state[p0]
        if "momentum" not in s0:  # AdamW (the embedding and head too: split by module); in every param group
            adamw_diff = max(adamw_diff, (safe_get_full_optimizer_state(p, "exp_avg") - s0["exp_avg"]).abs().max().item())
            continue
        exp_avg = safe_get_full_optimizer_state(p, "exp_avg")
        exp_avg_sq = safe_get_full_optimizer_state(p, "exp_avg_sq")
        momentum_diff = max(momentum_diff, (exp_avg - s0["momentum"]).abs().max().item())
        rows = exp_avg_sq.reshape(-1, exp_avg_sq.shape[-1]) if p.dim() == 3 else exp_avg_sq.reshape(p.shape[0], -1)
        row_spread = max(row_spread, (rows.max(-1).values - rows.min(-1).values).max().item())
        variance_diff = max(variance_diff, (rows[:, 0] - s0["variance"].reshape(-1)).abs().max().item())
    return {"momentum": momentum_diff, "variance": variance_diff, "row_spread": row_spread, "adamw": adamw_diff}


def _universal_resume(ckpt: str, tag: str, cfg: dict, target: dict) -> float:
    """Load a universal checkpoint under ``cfg``, train 2 steps: the largest difference to ``target``."""
    engine = make_engine({**cfg, "checkpoint": {"load_universal": True}}, seed=2)
    engine.load_checkpoint(ckpt, tag=tag)
    train(engine, 2, start=3)
    return max_diff(params_of(engine), target)


def session_two_ranks(rank: int, world: int, tmp: str) -> dict:
    init()
    out: dict[str, Any] = {"seconds": {}}
    t0 = time.time()

    # ZeRO-1/2 == ZeRO-0 (fp32, clipping active), with and without gradient accumulation.
    runs = {}
    for name, stage, ga, groups in [
        ("s0", 0, 1, False),
        ("s1", 1, 1, False),
        ("s2", 2, 1, False),
        ("s0_ga", 0, 2, True),
        ("s1_ga", 1, 2, True),
        ("s2_ga", 2, 2, True),
    ]:
        engine = make_engine(config(stage, ga, world=world), groups=groups)
        runs[name] = (engine, train(engine, 4))
    initial = params_of(make_engine(config(0, world=world)))
    p = {k: params_of(e) for k, (e, _) in runs.items()}
    out["diff"] = {k: max_diff(p[k], p["s0" if "ga" not in k else "s0_ga"]) for k in p if not k.startswith("s0")}
    out["moved"] = max_diff(p["s0"], initial)
    # "type": "dion3", the spelling of Megatron's --optimizer dion3: the same optimizer, the same steps.
    lower_case = config(1, world=world)
    lower_case["optimizer"]["type"] = "dion3"
    engine = make_engine(lower_case)
    train(engine, 4)
    out["lower_case_type"] = (type(_basic(engine)).__name__, max_diff(params_of(engine), p["s1"]))
    out["norms"] = runs["s1"][1]["norms"] + runs["s2_ga"][1]["norms"]
    out["state"] = _state_vs_stage0(runs["s2"][0], runs["s0"][0])
    flat_opt = _basic(runs["s1"][0])
    out["state_keys"] = [sorted(flat_opt.state[g["params"][0]]) for g in flat_opt.param_groups]
    out["state_shapes_match"] = all(
        flat_opt.state[g["params"][0]][k].shape == g["params"][0].shape for g in flat_opt.param_groups for k in ("exp_avg", "exp_avg_sq")
    )
    out["replicas_equal"] = _replicas_equal(runs["s2"][0])
    out["momentum_in_exp_avg"] = _momentum_in_exp_avg(flat_opt)
    out["straddling"] = {k: _straddling(runs[k][0]) for k in ("s1", "s2", "s2_ga")}
    del runs
    # fraction="auto": resolved on the slices (whole matrices here, straddling ones in the engine).
    auto = {stage: make_engine(config(stage, world=world, fraction="auto")) for stage in (0, 1)}
    for engine in auto.values():
        train(engine, 3)
    out["auto_diff"] = max_diff(params_of(auto[1]), params_of(auto[0]))
    chosen = {name: f for name, (_, f) in _basic(auto[1])._session.record.items()}
    matrices = [(piece.shard.name, piece.shard.sharding.kind == "full") for plan in partition_plans(auto[1]) for piece in plan.pieces]
    out["auto_fractions"] = {  # matrices one rank holds whole, and straddling ones
        "s0": sorted(set(_basic(auto[0]).fractions.values())),
        "s1_whole": sorted({chosen[name] for name, whole in matrices if whole}),
        "s1_engine": sorted({chosen[name] for name, whole in matrices if not whole}),
    }
    del auto
    out["seconds"]["equivalence"] = time.time() - t0

    # Checkpoint: save at step 3, resume == uninterrupted; ds_to_universal, then load at another stage.
    t0 = time.time()
    ckpt = os.path.join(tmp, "ckpt")
    engine = make_engine(config(2, world=world))
    train(engine, 3)
    engine.save_checkpoint(ckpt, tag="step3", client_state=dion3_ckpt.universal_checkpoint_info())
    uninterrupted = train(engine, 2, start=3)
    target = params_of(engine)
    resumed_engine = make_engine(config(2, world=world), seed=1)
    resumed_engine.load_checkpoint(ckpt, tag="step3")
    resumed = train(resumed_engine, 2, start=3)
    out["resume_diff"] = max_diff(params_of(resumed_engine), target)
    out["resume_losses"] = (uninterrupted["losses"], resumed["losses"])
    if rank == 0:
        dion3_ckpt.convert_to_universal(os.path.join(ckpt, "step3"), os.path.join(ckpt, "step3_universal"))
        torch.save(target, os.path.join(tmp, "target.pt"))
    dist.barrier()
    out["universal_diff"] = _universal_resume(ckpt, "step3_universal", config(1, world=world), target)
    out["seconds"]["checkpoint"] = time.time() - t0

    # staleness: the rows' ages in the slice state; ZeRO-1/2 == ZeRO-0, a resume bit-identical,
    # and the universal conversion keeps the ages.
    t0 = time.time()
    stale = {}
    for name, stage in [("s0", 0), ("s1", 1), ("s2", 2)]:
        engine = make_engine(config(stage, world=world, staleness=1.0))
        train(engine, 4)
        stale[name] = params_of(engine)
    out["stale_diff"] = {k: max_diff(stale[k], stale["s0"]) for k in ("s1", "s2")}
    plain = make_engine(config(0, world=world, staleness=0.0))  # plain top-k: what the ages must change
    train(plain, 4)
    out["stale_vs_plain"] = max_diff(stale["s0"], params_of(plain))
    out["stale_straddling"] = _straddling(engine)
    flat_opt = _basic(engine)
    out["stale_state_keys"] = [sorted(flat_opt.state[g["params"][0]]) for g in flat_opt.param_groups]
    from deepspeed.utils import safe_get_full_optimizer_state  # the ages reach ZeRO's fragments too

    out["stale_fragment_age"] = max(safe_get_full_optimizer_state(p, "row_age").max().item() for p in engine.module.parameters())
    ckpt = os.path.join(tmp, "stale_ckpt")
    engine = make_engine(config(2, world=world, staleness=1.0))
    train(engine, 3)
    engine.save_checkpoint(ckpt, tag="step3", client_state=dion3_ckpt.universal_checkpoint_info())
    train(engine, 2, start=3)
    target = params_of(engine)
    resumed_engine = make_engine(config(2, world=world, staleness=1.0), seed=1)
    resumed_engine.load_checkpoint(ckpt, tag="step3")
    train(resumed_engine, 2, start=3)
    out["stale_resume_diff"] = max_diff(params_of(resumed_engine), target)
    if rank == 0:
        dion3_ckpt.convert_to_universal(os.path.join(ckpt, "step3"), os.path.join(ckpt, "step3_universal"))
        torch.save(target, os.path.join(tmp, "stale_target.pt"))
        # the stock converter alone: no ages (the control that the ages matter)
        from deepspeed.checkpoint import ds_to_universal

        ds_to_universal.main(dion3_ckpt._converter_args(os.path.join(ckpt, "step3"), os.path.join(ckpt, "stock"), 1))
    dist.barrier()
    out["stale_universal_ages"] = len(glob.glob(os.path.join(ckpt, "step3_universal", "zero", "*", "row_age.pt")))
    out["stale_universal_diff"], out["stale_universal_without_ages_diff"] = (
        _universal_resume(ckpt, tag, config(1, world=world, staleness=1.0), target) for tag in ("step3_universal", "stock")
    )
    out["seconds"]["staleness"] = time.time() - t0

    # fraction="auto" resumed where the device measures another speed: the saved choices, bit-identical.
    t0 = time.time()
    from dion3_megatron.core import cost_model
    from dion3_megatron.engine import fractions

    min_rows, measure, tokens = cost_model.MIN_SELECTED_ROWS, fractions.measure, cost_model.TOKENS_PER_STEP
    cost_model.MIN_SELECTED_ROWS = 1  # the test model's matrices have <= 20 rows: let the speed decide
    cost_model.TOKENS_PER_STEP = 0  # and the step be the whole iteration
    try:
        fractions.measure = lambda device, dtype: cost_model.DeviceSpeed(1e6, 0.0, 1e30, 1e30)  # slow matmuls: f = 1/8
        engine = make_engine(config(2, world=world, fraction="auto"))
        train(engine, 3)
        engine.save_checkpoint(os.path.join(tmp, "auto_ckpt"), tag="step3", client_state=dion3_ckpt.universal_checkpoint_info())
        train(engine, 2, start=3)
        if rank == 0:  # resumed by the 4-rank session from a universal checkpoint
            dion3_ckpt.convert_to_universal(os.path.join(tmp, "auto_ckpt", "step3"), os.path.join(tmp, "auto_ckpt", "step3_universal"))
            torch.save(params_of(engine), os.path.join(tmp, "auto_target.pt"))
        dist.barrier()
        sd = _basic(engine).state_dict()
        out["auto_resume_chosen"] = [group["fractions"] for group in sd["param_groups"]]
        out["auto_resume_top_level"] = sorted(k for k in sd if k not in ("state", "param_groups", "skipped_steps"))
        out["auto_resume_names"] = sorted({n for plan in partition_plans(engine) for n in plan.names})
        out["auto_resume_straddling"] = [
            piece.shard.name for plan in partition_plans(engine) for piece in plan.pieces if piece.shard.sharding.kind != "full"
        ]
        fractions.measure = lambda device, dtype: cost_model.DeviceSpeed(1e30, 1.0, 1e30, 1e30)  # slow launches: f = 1
        resumed_engine = make_engine(config(2, world=world, fraction="auto"), seed=1)
        resumed_engine.load_checkpoint(os.path.join(tmp, "auto_ckpt"), tag="step3")
        train(resumed_engine, 2, start=3)
        out["auto_resume_diff"] = max_diff(params_of(resumed_engine), params_of(engine))
    finally:
        cost_model.MIN_SELECTED_ROWS, fractions.measure, cost_model.TOKENS_PER_STEP = min_rows, measure, tokens
    out["seconds"]["auto_resume"] = time.time() - t0

    # bf16: ZeRO-1 trains and stays close to ZeRO-0 bf16.
    t0 = time.time()
    bf16 = {}
    fp32_accumulation = {"data_types": {"grad_accum_dtype": "fp32"}}  # ZeRO-1 then runs DeepSpeed's BF16_Optimizer
    for name, cfg in [
        ("s0", config(0, dtype="bf16", world=world)),
        ("s1", config(1, dtype="bf16", world=world)),
        ("s1_fp32acc", {**config(1, dtype="bf16", world=world), **fp32_accumulation}),
    ]:
        engine = make_engine(cfg)
        bf16[name] = (train(engine, 6, fixed=True)["losses"], params_of(engine), _basic(engine), type(engine.optimizer).__name__)
    out["bf16_losses"] = {k: v[0] for k, v in bf16.items()}
    out["bf16_wrappers"] = {k: v[3] for k, v in bf16.items()}
    out["bf16_diff"] = {k: max_diff(bf16["s0"][1], bf16[k][1]) for k in ("s1", "s1_fp32acc")}
    out["bf16_state_dtypes"] = sorted(
        {
            str(v.dtype)
            for k in ("s1", "s1_fp32acc")
            for s in bf16[k][2].state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim()
        }
    )
    out["seconds"]["bf16"] = time.time() - t0

    # A non-finite gradient on one rank skips the step on every rank (no hang, nothing changed).
    engine = make_engine(config(2, world=world))
    train(engine, 1)
    before = params_of(engine)
    loss = engine(batch(5, 0, world))
    engine.backward(loss * float("nan") if rank == 0 else loss)
    engine.step()
    out["nan_step_change"] = max_diff(before, params_of(engine))
    train(engine, 1, start=6)
    out["nan_then_finite"] = all(torch.isfinite(p).all().item() for p in params_of(engine).values())
    out["nan_skipped"] = engine.skipped_steps + _basic(engine).skipped_steps
    # Dion3's own gate: a NaN in one partition (the second param group's slice) on rank 0 only.
    out["own_guard"] = {stage: nan_in_one_partition(make_engine(config(stage, world=world)), 1) for stage in (1, 2)}
    out["refused_on_one_rank"] = _refused_on_one_rank(make_engine(config(2, world=world)))

    # Bad configs fail at initialize with a clear message.
    out["errors"] = {
        "unknown": init_error(config(1, world=world, momentum=0.9, fractoin=0.5)),
        "range": init_error(config(2, world=world, fraction=0.0)),
        "type": init_error(config(0, world=world, lr="0.1")),
        "betas": init_error(config(1, world=world, betas=[0.9])),
        **{f"type {name}": init_error(_with_type(config(1, world=world), name)) for name in NEAR_MISSES},
    }
    # Dion3's name in any case builds it
    out["any_case"] = {
        name: type(_basic(make_engine(_with_type(config(1, world=world), name)))).__name__ for name in ("DION3", "dion3", "Dion3")
    }
    return out


NEAR_MISSES = ("Dion", "dion-3", "Dion3Optimizer")


def _with_type(cfg: dict, name: str) -> dict:
    """``cfg`` (a JSON config dict) with ``"optimizer": {"type": name}``."""
    return {**cfg, "optimizer": {**cfg["optimizer"], "type": name}}


def _auto_universal_resume(tmp: str, world: int) -> dict:
    """The 2-rank fraction="auto" checkpoint, converted to a universal one, resumed at ``world``
    ranks on a device whose speed alone would choose f = 1: the saved choices (1/8), the same steps."""
    from dion3_megatron.core import cost_model
    from dion3_megatron.engine import fractions

    saved = cost_model.MIN_SELECTED_ROWS, fractions.measure, cost_model.TOKENS_PER_STEP
    cost_model.MIN_SELECTED_ROWS, cost_model.TOKENS_PER_STEP = 1, 0
    fractions.measure = lambda device, dtype: cost_model.DeviceSpeed(1e30, 1.0, 1e30, 1e30)  # slow launches: f = 1
    try:
        engine = make_engine({**config(2, world=world, fraction="auto"), "checkpoint": {"load_universal": True}}, seed=3)
        engine.load_checkpoint(os.path.join(tmp, "auto_ckpt"), tag="step3_universal")
        train(engine, 2, start=3)
        record = [group["fractions"] for group in _basic(engine).state_dict()["param_groups"]]
        return {
            "diff": max_diff(params_of(engine), torch.load(os.path.join(tmp, "auto_target.pt"))),
            "fractions": sorted({f for r in record for f in r.values()}),
            "matrices": sum(map(len, record)),
        }
    finally:
        cost_model.MIN_SELECTED_ROWS, fractions.measure, cost_model.TOKENS_PER_STEP = saved


def _momentum_in_exp_avg(opt) -> tuple[int, int]:
    """(matrices whose engine momentum lies in their partition's exp_avg, all matrices): the engine
    steps exp_avg where it lies, no second copy of the momentum."""
    inside = total = 0
    for plan in opt._step_plan.partitions:
        exp_avg = opt.state[plan.flat]["exp_avg"]
        start, end = exp_avg.data_ptr(), exp_avg.data_ptr() + exp_avg.numel() * exp_avg.element_size()
        for piece in plan.pieces:
            total += 1
            inside += start <= piece.shard.state["momentum"].data_ptr() < end
    return inside, total


def _straddling(engine) -> int:
    """Dion3 matrices whose elements lie on more than one rank's ZeRO slice."""
    count = 0
    for plan in partition_plans(engine):
        for piece in plan.pieces:
            b = piece.shard.sharding.bounds
            count += sum(hi > lo for lo, hi in zip(b, b[1:])) > 1
    return count


def _replicas_equal(engine) -> bool:
    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def session_four_ranks(rank: int, world: int, tmp: str) -> dict:
    """More straddling (4 slices), and elastic loading of the 2-rank universal checkpoints."""
    init()
    out: dict[str, Any] = {}
    runs = {}
    for stage in (0, 2):
        engine = make_engine(config(stage, ga=2, world=world))
        train(engine, 3)
        runs[stage] = params_of(engine)
        if stage == 2:
            out["straddling"] = _straddling(engine)
    out["diff"] = max_diff(runs[2], runs[0])
    # MoE: experts are stepped over their expert-data-parallel group (2 of the 4 ranks). No
    # clipping here: DeepSpeed's stage-0 clip measures an MoE model's norm differently from ZeRO's
    # (the runs then differ by ~3e-5 whatever the optimizer; without clipping they agree to 1e-6).
    moe = {}
    for stage in (0, 2):
        engine = make_engine(config(stage, world=world, clip=0.0), model_class=MoENet)
        train(engine, 3)
        moe[stage] = params_of(engine)
        if stage == 2:
            out["moe_group_sizes"] = sorted(p.world for p in partition_plans(engine))
            out["moe_expert_params"] = sum("experts" in n for n in moe[stage])
    out["moe_diff"] = max_diff(moe[2], moe[0])
    universal = os.path.join(tmp, "ckpt")
    engine = make_engine({**config(2, world=world), "checkpoint": {"load_universal": True}}, seed=3)
    engine.load_checkpoint(universal, tag="step3_universal")
    train(engine, 2, start=3)
    out["universal_diff"] = max_diff(params_of(engine), torch.load(os.path.join(tmp, "target.pt")))
    # The same with staleness: the rows' ages, saved by 2 ranks, re-sliced for 4.
    engine = make_engine({**config(2, world=world, staleness=1.0), "checkpoint": {"load_universal": True}}, seed=3)
    engine.load_checkpoint(os.path.join(tmp, "stale_ckpt"), tag="step3_universal")
    train(engine, 2, start=3)
    out["stale_universal_diff"] = max_diff(params_of(engine), torch.load(os.path.join(tmp, "stale_target.pt")))
    out["auto_universal"] = _auto_universal_resume(tmp, world)
    # Last: deepspeed.initialize(mpu=...) leaves the mpu set for the rest of the process.
    out["tensor_parallel"] = {stage: tensor_parallel_vs_single_process(stage) for stage in (1, 2)}
    out["tensor_parallel_bf16"] = tensor_parallel_vs_single_process(1, bf16=True)
    out["tensor_parallel_stage0_warns"] = tensor_parallel_without_zero_warns()
    return out
