"""DeepSpeed on CPU for the tests: gloo, no op builds, a tiny model whose matrices straddle ZeRO slices.

The session functions run in spawned workers (tests/dist_utils.run_distributed). Importing this
module changes nothing: the environment (DS_ACCELERATOR=cpu, no torch.compile) is set and
DeepSpeed imported by :func:`init`, in the worker, so the pytest process and the other tests'
workers never see it.
"""

from __future__ import annotations

import importlib
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

        expert = torch.nn.Sequential(torch.nn.Linear(WIDTH, 16, bias=False), torch.nn.GELU(),
                                     torch.nn.Linear(16, WIDTH, bias=False))
        self.moe = MoE(hidden_size=WIDTH, expert=expert, num_experts=4, ep_size=ep_size, k=1, capacity_factor=8.0,
                       min_capacity=0, drop_tokens=False, use_rts=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        out, aux, _ = self.moe(h)
        logits = self.head(self.norm(h + out)).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten()) + 0.01 * aux


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
        "optimizer": {"type": "Dion3", "params": {"lr": 0.02, "fraction": 0.5, "ns_dtype": "float64", **params}},
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


def _state_vs_stage0(zero_engine, stage0_engine) -> dict:
    """Full ZeRO slice state of every matrix vs stage 0's per-parameter Dion3 state."""
    from deepspeed.utils import safe_get_full_optimizer_state

    ref = _basic(stage0_engine)
    momentum_diff = variance_diff = row_spread = 0.0
    for (name, p), p0 in zip(zero_engine.module.named_parameters(), stage0_engine.module.parameters()):
        if p.dim() < 2:
            continue
        exp_avg = safe_get_full_optimizer_state(p, "exp_avg")
        exp_avg_sq = safe_get_full_optimizer_state(p, "exp_avg_sq")
        s0 = ref.state[p0]
        momentum_diff = max(momentum_diff, (exp_avg - s0["momentum"]).abs().max().item())
        rows = exp_avg_sq.reshape(-1, exp_avg_sq.shape[-1]) if p.dim() == 3 else exp_avg_sq.reshape(p.shape[0], -1)
        row_spread = max(row_spread, (rows.max(-1).values - rows.min(-1).values).max().item())
        variance_diff = max(variance_diff, (rows[:, 0] - s0["variance"].reshape(-1)).abs().max().item())
    return {"momentum": momentum_diff, "variance": variance_diff, "row_spread": row_spread}


def session_two_ranks(rank: int, world: int, tmp: str) -> dict:
    init()
    out: dict[str, Any] = {"seconds": {}}
    t0 = time.time()

    # ZeRO-1/2 == ZeRO-0 (fp32, clipping active), with and without gradient accumulation.
    runs = {}
    for name, stage, ga, groups in [("s0", 0, 1, False), ("s1", 1, 1, False), ("s2", 2, 1, False),
                                    ("s0_ga", 0, 2, True), ("s1_ga", 1, 2, True), ("s2_ga", 2, 2, True)]:
        engine = make_engine(config(stage, ga, world=world), groups=groups)
        runs[name] = (engine, train(engine, 4))
    initial = params_of(make_engine(config(0, world=world)))
    p = {k: params_of(e) for k, (e, _) in runs.items()}
    out["diff"] = {k: max_diff(p[k], p["s0" if "ga" not in k else "s0_ga"]) for k in p if not k.startswith("s0")}
    out["moved"] = max_diff(p["s0"], initial)
    out["norms"] = runs["s1"][1]["norms"] + runs["s2_ga"][1]["norms"]
    out["state"] = _state_vs_stage0(runs["s2"][0], runs["s0"][0])
    flat_opt = _basic(runs["s1"][0])
    out["state_keys"] = [sorted(flat_opt.state[g["params"][0]]) for g in flat_opt.param_groups]
    out["state_shapes_match"] = all(
        flat_opt.state[g["params"][0]][k].shape == g["params"][0].shape for g in flat_opt.param_groups
        for k in ("exp_avg", "exp_avg_sq"))
    out["replicas_equal"] = _replicas_equal(runs["s2"][0])
    out["straddling"] = {k: _straddling(runs[k][0]) for k in ("s1", "s2", "s2_ga")}
    del runs
    # fraction="auto": resolved on the slices (whole matrices here, straddling ones in the engine).
    auto = {stage: make_engine(config(stage, world=world, fraction="auto")) for stage in (0, 1)}
    for engine in auto.values():
        train(engine, 3)
    out["auto_diff"] = max_diff(params_of(auto[1]), params_of(auto[0]))
    zero_plans = _basic(auto[1])._zero_plans.values()
    out["auto_fractions"] = {
        "s0": sorted(set(_basic(auto[0]).fractions.values())),
        "s1_whole": sorted({f for plan in zero_plans for f in plan.whole_fractions}),
        "s1_engine": sorted({f for plan in zero_plans if plan.engine for f in plan.engine.auto_fractions().values()}),
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
    universal_engine = make_engine({**config(1, world=world), "checkpoint": {"load_universal": True}}, seed=2)
    universal_engine.load_checkpoint(ckpt, tag="step3_universal")
    train(universal_engine, 2, start=3)
    out["universal_diff"] = max_diff(params_of(universal_engine), target)
    out["seconds"]["checkpoint"] = time.time() - t0

    # bf16: ZeRO-1 trains and stays close to ZeRO-0 bf16.
    t0 = time.time()
    bf16 = {}
    fp32_accumulation = {"data_types": {"grad_accum_dtype": "fp32"}}  # ZeRO-1 then runs DeepSpeed's BF16_Optimizer
    for name, cfg in [("s0", config(0, dtype="bf16", world=world)), ("s1", config(1, dtype="bf16", world=world)),
                      ("s1_fp32acc", {**config(1, dtype="bf16", world=world), **fp32_accumulation})]:
        engine = make_engine(cfg)
        bf16[name] = (train(engine, 6, fixed=True)["losses"], params_of(engine), _basic(engine),
                      type(engine.optimizer).__name__)
    out["bf16_losses"] = {k: v[0] for k, v in bf16.items()}
    out["bf16_wrappers"] = {k: v[3] for k, v in bf16.items()}
    out["bf16_diff"] = {k: max_diff(bf16["s0"][1], bf16[k][1]) for k in ("s1", "s1_fp32acc")}
    out["bf16_state_dtypes"] = sorted({str(v.dtype) for k in ("s1", "s1_fp32acc") for s in bf16[k][2].state.values()
                                       for v in s.values() if torch.is_tensor(v) and v.dim()})
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
    # The same guard inside Dion3 itself, for callers that step the slices directly.
    basic = _basic(engine)
    flats = [g["params"][0] for g in basic.param_groups]
    for f in flats:
        f.grad = torch.ones_like(f)
    if rank == 0:
        flats[0].grad[0] = float("inf")
    kept = [f.detach().clone() for f in flats]
    skipped = basic.skipped_steps
    basic.step()
    out["own_guard"] = (all(torch.equal(a, f) for a, f in zip(kept, flats)), basic.skipped_steps - skipped)

    # Bad configs fail at initialize with a clear message.
    out["errors"] = {
        "unknown": init_error(config(1, world=world, momentum=0.9, fractoin=0.5)),
        "range": init_error(config(2, world=world, fraction=0.0)),
        "type": init_error(config(0, world=world, lr="0.1")),
        "betas": init_error(config(1, world=world, betas=[0.9])),
        "stage3": init_error(config(3, world=world)),
    }
    return out


def _straddling(engine) -> int:
    """Dion3 matrices whose elements lie on more than one rank's ZeRO slice."""
    count = 0
    for plan in _basic(engine)._zero_plans.values():
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
    """More straddling (4 slices), and elastic loading of the 2-rank universal checkpoint."""
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
            plans = _basic(engine)._zero_plans.values()
            out["moe_group_sizes"] = sorted(p.world for p in plans)
            out["moe_expert_params"] = sum("experts" in n for n in moe[stage])
    out["moe_diff"] = max_diff(moe[2], moe[0])
    universal = os.path.join(tmp, "ckpt")
    engine = make_engine({**config(2, world=world), "checkpoint": {"load_universal": True}}, seed=3)
    engine.load_checkpoint(universal, tag="step3_universal")
    train(engine, 2, start=3)
    out["universal_diff"] = max_diff(params_of(engine), torch.load(os.path.join(tmp, "target.pt")))
    return out
