"""DeepSpeed ZeRO stage 3 on CPU (gloo) for tests/integration/test_deepspeed_zero3.py: one session per world
size, each comparing stage 3 with stage 0 (the whole-parameter Dion3 step) on the same model and
global batches. Uses :mod:`support.deepspeed_helpers` for the environment, configs and training."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from . import deepspeed_helpers as h


class Zero3Net(h.Net):
    """Net plus a 5 x 7 matrix (35 elements: ZeRO-3's pieces of it are uneven at 2 and 4 ranks) and
    a 1 x 3 matrix (fewer elements than 4 ranks: one rank holds only padding of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.odd = torch.nn.Parameter(torch.randn(5, 7) * 0.3)
        self.tiny = torch.nn.Parameter(torch.randn(1, 3) * 0.3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h_ = self.embed(tokens)
        h_ = h_ + self.fc2(torch.nn.functional.gelu(self.fc1(h_)))
        h_ = h_ + torch.tanh(h_[..., :7] @ self.odd.T).sum(-1, keepdim=True) + h_[..., :3] @ self.tiny.T
        e = torch.einsum("btd,end->bten", h_, self.experts)
        h_ = h_ + torch.einsum("bten,end->btd", torch.tanh(e), self.experts) / h.EXPERTS
        logits = self.head(self.norm(h_)).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())


def zero3_config(world: int, ga: int = 1, sub_group_size: int | None = None, **params: Any) -> dict:
    cfg = h.config(3, ga, world=world, **params)
    # Every parameter gathered for its forward and partitioned again (DeepSpeed would keep small ones whole).
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if sub_group_size is not None:
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    return cfg


def make(cfg: dict, seed: int = 0, zero_init: bool = False):
    """An engine for Zero3Net; ``zero_init``: the model built under ``deepspeed.zero.Init`` (its
    parameters partitioned as they are created)."""
    torch.manual_seed(seed)
    if zero_init:
        with h.deepspeed.zero.Init(config_dict_or_path=cfg):
            model = Zero3Net()
    else:
        model = Zero3Net()
    engine, *_ = h.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def pieces(engine) -> dict[str, list[str]]:
    """Sharding kind and length (elements here) of every Dion3 matrix piece this rank steps, by
    "matrix name (shape)"."""
    out: dict[str, list] = {}
    for plan in h.partition_plans(engine):
        for piece in plan.pieces:
            out.setdefault(f"{piece.shard.name} {tuple(piece.shard.shape)}", []).append((piece.shard.sharding.kind, piece.length))
    return out


class EngineSteps:
    """Counts the Dion3 engine steps (each selects rows and orthogonalizes once) while active."""

    def __enter__(self) -> "EngineSteps":
        from dion3_megatron.engine import Dion3Engine

        self.count, self._cls, self._step = 0, Dion3Engine, Dion3Engine.step

        def counted(engine, *args, **kwargs):
            self.count += 1
            return self._step(engine, *args, **kwargs)

        Dion3Engine.step = counted
        return self

    def __exit__(self, *exc) -> None:
        self._cls.step = self._step


def state_vs_stage0(engine, stage0) -> dict[str, float]:
    """Every matrix's momentum and row variance (through DeepSpeed's own accessor, which gathers the
    ZeRO-3 partitions) and the AdamW first moments, against stage 0's state."""
    from deepspeed.utils import safe_get_full_optimizer_state

    ref = h._basic(stage0)
    out = {"momentum": 0.0, "variance": 0.0, "adamw": 0.0}
    for p, p0 in zip(engine.module.parameters(), stage0.module.parameters()):
        s0 = ref.state[p0]
        exp_avg = safe_get_full_optimizer_state(p, "exp_avg")
        if "momentum" not in s0:
            out["adamw"] = max(out["adamw"], (exp_avg - s0["exp_avg"]).abs().max().item())
            continue
        out["momentum"] = max(out["momentum"], (exp_avg - s0["momentum"]).abs().max().item())
        rows = safe_get_full_optimizer_state(p, "exp_avg_sq").reshape(s0["variance"].numel(), -1)
        out["variance"] = max(out["variance"], (rows[:, 0] - s0["variance"].reshape(-1)).abs().max().item())
    return out


def _nan_step(engine, world: int) -> dict:
    """A NaN gradient on rank 0 only: the step is skipped on every rank, the next one is taken."""
    rank = dist.get_rank()
    h.train(engine, 1)
    before = h.params_of(engine)
    loss = engine(h.batch(5, 0, world))
    engine.backward(loss * float("nan") if rank == 0 else loss)
    engine.step()
    change = h.max_diff(before, h.params_of(engine))
    h.train(engine, 1, start=6)
    after = h.params_of(engine)
    return {
        "change": change,
        "skipped": engine.skipped_steps + h._basic(engine).skipped_steps,
        "then_moved": h.max_diff(before, after),
        "finite": all(torch.isfinite(t).all().item() for t in after.values()),
    }


def session_two_ranks(rank: int, world: int, tmp: str) -> dict:
    h.init()
    from dion3_megatron.deepspeed import zero3

    out: dict[str, Any] = {"seconds": {}}
    t0 = time.time()
    cfg0, cfg3 = h.config(0, world=world), zero3_config(world)
    stage0 = make(cfg0)
    initial = h.params_of(stage0)
    h.train(stage0, 4)
    reference = h.params_of(stage0)
    out["moved"] = h.max_diff(reference, initial)
    runs = {}
    for name, zero_init in (("s3", False), ("s3_zero_init", True)):
        engine = make(cfg3, zero_init=zero_init)
        out.setdefault("initial_diff", {})[name] = h.max_diff(h.params_of(engine), initial)
        h.train(engine, 4)
        runs[name] = engine
        out.setdefault("diff", {})[name] = h.max_diff(h.params_of(engine), reference)
        out.setdefault("pieces", {})[name] = pieces(engine)
        out.setdefault("algorithms", {})[name] = [g["algorithm"] for g in h._basic(engine).param_groups]
    out["norms"] = h.train(make(cfg3), 2)["norms"]  # clipping at 0.5 active: the norms are larger
    out["state"] = state_vs_stage0(runs["s3"], stage0)
    flat_opt = h._basic(runs["s3"])
    sub_groups = zero3.partitions_of(runs["s3"].optimizer)
    out["state_keys"] = [sorted(flat_opt.state[s.flat]) for s in sub_groups]
    out["state_shapes_match"] = all(
        flat_opt.state[s.flat][k].shape == s.flat.shape for s in sub_groups for k in ("exp_avg", "exp_avg_sq", "row_age")
    )
    out["params_between_steps"] = [len(g["params"]) for g in flat_opt.param_groups]
    del runs
    # Gradient accumulation: the rule runs once per optimizer step, not per micro-batch.
    stage0 = make(h.config(0, ga=3, world=world))
    h.train(stage0, 3)
    engine = make(zero3_config(world, ga=3))
    with EngineSteps() as steps:
        h.train(engine, 3)
    out["ga_diff"] = h.max_diff(h.params_of(engine), h.params_of(stage0))
    out["ga_engine_steps"] = (steps.count, sum(plan.steps_matrices for plan in h.partition_plans(engine)))
    out["seconds"]["equivalence"] = time.time() - t0

    t0 = time.time()
    out["nan"] = _nan_step(make(cfg3), world)
    # Dion3's own gate: a NaN in one sub-group's partition on rank 0 only, several sub-groups per group.
    out["nan_in_one_partition"] = h.nan_in_one_partition(make(zero3_config(world, sub_group_size=100)), 1)
    out["seconds"]["nan"] = time.time() - t0
    # 1, 2 and 5 sub-groups of the Dion3 group (5 matrices; at size 1 each is a sub-group of its own)
    out["collectives"] = {size: collectives_per_step(world, size) for size in (10**9, 250, 1)}

    # Checkpoints: save at step 3; resume at the same world size == uninterrupted; universal conversion.
    t0 = time.time()
    ckpt = os.path.join(tmp, "ckpt3")
    engine = make(cfg3)
    h.train(engine, 3)
    engine.save_checkpoint(ckpt, tag="step3", client_state=h.dion3_ckpt.universal_checkpoint_info())
    h.train(engine, 2, start=3)
    target = h.params_of(engine)
    resumed = make(cfg3, seed=1)
    resumed.load_checkpoint(ckpt, tag="step3")
    h.train(resumed, 2, start=3)
    out["resume_diff"] = h.max_diff(h.params_of(resumed), target)
    if rank == 0:
        h.dion3_ckpt.convert_to_universal(os.path.join(ckpt, "step3"), os.path.join(ckpt, "step3_universal"))
        torch.save(target, os.path.join(tmp, "target3.pt"))
        from deepspeed.checkpoint import ds_to_universal  # the stock converter: no row ages

        ds_to_universal.main(h.dion3_ckpt._converter_args(os.path.join(ckpt, "step3"), os.path.join(ckpt, "stock"), 1))
    dist.barrier()
    out["universal_diff"], out["universal_without_ages_diff"] = (
        universal_resume(ckpt, tag, cfg3, target) for tag in ("step3_universal", "stock")
    )
    out["seconds"]["checkpoint"] = time.time() - t0

    t0 = time.time()
    out["auto"] = _auto_fraction_resume(world, os.path.join(tmp, "auto3"))
    out["seconds"]["auto"] = time.time() - t0

    # A plain parameter list built under zero.Init (every shape empty): split by the logical shapes.
    from dion3_megatron.deepspeed import DeepSpeedDion3

    with h.deepspeed.zero.Init(config_dict_or_path=cfg3):
        model = Zero3Net()
    out["plain_list_zero_init"] = [
        (g["algorithm"], sorted(len(p.ds_shape) for p in g["params"])) for g in DeepSpeedDion3(model.parameters()).param_groups
    ]

    return out


def _auto_fraction_resume(world: int, ckpt: str) -> dict:
    """fraction="auto" over several sub-groups per param group: saved, then resumed where the
    device measures another speed (which alone would choose another f): the saved choices, the
    same steps."""
    from dion3_megatron.core import cost_model
    from dion3_megatron.engine import fractions

    saved = cost_model.MIN_SELECTED_ROWS, fractions.measure, cost_model.TOKENS_PER_STEP
    cost_model.MIN_SELECTED_ROWS = 1  # the test model's matrices have <= 20 rows: let the speed decide
    cost_model.TOKENS_PER_STEP = 0  # and the step be the whole iteration
    cfg = zero3_config(world, sub_group_size=100, fraction="auto")
    try:
        fractions.measure = lambda device, dtype: cost_model.DeviceSpeed(1e6, 0.0, 1e30, 1e30)  # slow matmuls: f = 1/8
        engine = make(cfg)
        h.train(engine, 3)
        engine.save_checkpoint(ckpt, tag="step3")
        h.train(engine, 2, start=3)
        saved = engine.optimizer.state_dict()["optimizer_state_dict"]  # ZeRO-3 fills the groups for it
        record = [group["fractions"] for group in saved["param_groups"]]
        fractions.measure = lambda device, dtype: cost_model.DeviceSpeed(1e30, 1.0, 1e30, 1e30)  # slow launches: f = 1
        resumed = make(cfg, seed=1)
        resumed.load_checkpoint(ckpt, tag="step3")
        h.train(resumed, 2, start=3)
        return {
            "diff": h.max_diff(h.params_of(resumed), h.params_of(engine)),
            "record": record,
            "dion3_partitions": sum(plan.steps_matrices for plan in h.partition_plans(engine)),
        }
    finally:
        cost_model.MIN_SELECTED_ROWS, fractions.measure, cost_model.TOKENS_PER_STEP = saved


class Collectives:
    """Counts the torch.distributed collectives made inside Dion3's ``step()`` while active."""

    NAMES = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "reduce_scatter_tensor",
        "send",
        "recv",
    )

    def __init__(self, optimizer) -> None:
        self.optimizer, self.count, self.inside = optimizer, 0, False

    def __enter__(self) -> "Collectives":
        self._saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, function in self._saved.items():
            setattr(dist, name, self._counted(function))
        self._step = self.optimizer.step

        def step(*args, **kwargs):
            self.inside = True
            try:
                return self._step(*args, **kwargs)
            finally:
                self.inside = False

        self.optimizer.step = step
        return self

    def _counted(self, function):
        def counted(*args, **kwargs):
            self.count += self.inside
            return function(*args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        for name, function in self._saved.items():
            setattr(dist, name, function)
        del self.optimizer.step


def collectives_per_step(world: int, sub_group_size: int) -> dict:
    """Dion3's collectives in each of 3 steps (the first builds the engine) at this sub_group_size,
    the number of sub-groups of the Dion3 param group, and the parameters against stage 0's."""
    stage0 = make(h.config(0, world=world))
    h.train(stage0, 3)
    engine = make(zero3_config(world, sub_group_size=sub_group_size))
    counts = []
    for step in range(3):
        with Collectives(h._basic(engine)) as counted:
            h.train(engine, 1, start=step)
        counts.append(counted.count)
    from dion3_megatron.deepspeed import zero3

    return {
        "counts": counts,
        "dion3_sub_groups": [p.group_index for p in zero3.partitions_of(engine.optimizer)].count(0),
        "diff": h.max_diff(h.params_of(engine), h.params_of(stage0)),
    }


def universal_resume(ckpt: str, tag: str, cfg: dict, target: dict, zero_init: bool = False) -> float:
    """Load a universal checkpoint under ``cfg``, train 2 steps: the largest difference to ``target``."""
    engine = make({**cfg, "checkpoint": {"load_universal": True}}, seed=2, zero_init=zero_init)
    engine.load_checkpoint(ckpt, tag=tag)
    h.train(engine, 2, start=3)
    return h.max_diff(h.params_of(engine), target)


def session_four_ranks(rank: int, world: int, tmp: str) -> dict:
    """Smaller pieces (a matrix of fewer elements than ranks), several sub-groups per param group,
    zero.Init with gradient accumulation, the 2-rank universal checkpoint loaded at 4, and tensor
    parallelism (TP=2 x DP=2)."""
    h.init()
    from dion3_megatron.deepspeed import zero3

    out: dict[str, Any] = {}
    stage0 = make(h.config(0, ga=2, world=world))
    h.train(stage0, 3)
    engine = make(zero3_config(world, ga=2, sub_group_size=100), zero_init=True)
    h.train(engine, 3)
    out["diff"] = h.max_diff(h.params_of(engine), h.params_of(stage0))
    out["pieces"] = pieces(engine)
    out["sub_groups"] = [s.group_index for s in zero3.partitions_of(engine.optimizer)]
    out["plans"] = len(h.partition_plans(engine))
    target = torch.load(os.path.join(tmp, "target3.pt"))
    ckpt = os.path.join(tmp, "ckpt3")
    out["universal_diff"] = universal_resume(ckpt, "step3_universal", zero3_config(world), target, zero_init=True)
    # Last: deepspeed.initialize(mpu=...) leaves the mpu set for the rest of the process.
    out["tensor_parallel"] = h.tensor_parallel_vs_single_process(3)
    out["tensor_parallel_bf16"] = h.tensor_parallel_vs_single_process(3, bf16=True)
    return out
