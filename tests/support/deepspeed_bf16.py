"""DeepSpeed with a bf16 momentum (``"momentum_dtype": "bf16"``) on CPU (gloo) for
tests/integration/test_deepspeed_bf16_momentum.py: one 2-rank session comparing ZeRO stages 1-3
with stage 0, reading the partitions' state, resuming regular and universal checkpoints. Uses
:mod:`support.deepspeed_helpers` for the environment, configs and training."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import deepspeed_helpers as h
from .deepspeed_zero3 import zero3_config

STEPS = 4


def config(stage: int, world: int, momentum_dtype: str = "bf16") -> dict:
    """The tests' config at ``stage`` with a bf16 momentum (ZeRO-3: every parameter partitioned)."""
    return zero3_config(world, momentum_dtype=momentum_dtype) if stage == 3 else h.config(stage, world=world, momentum_dtype=momentum_dtype)


def _partitions(engine) -> list[tuple[dict, dict]]:
    """(param group, state) of every flat partition this rank steps."""
    opt = h._basic(engine)
    return [(opt._groups[part.group_index], opt.state[part.flat]) for part in opt._partitions]


def state_of(engine) -> dict[str, Any]:
    """The dtypes of the partitions' state by the algorithm of their group, the bytes of the Dion3
    groups' state per element of their partitions, and copies of every partition's state."""
    dtypes: dict[str, set[str]] = {}
    dion3_bytes = dion3_elements = 0
    for group, state in _partitions(engine):
        tensors = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim()}
        dtypes.setdefault(group["algorithm"], set()).update(f"{k} {v.dtype}" for k, v in tensors.items())
        if group["algorithm"] == "dion3":
            dion3_bytes += sum(v.numel() * v.element_size() for v in tensors.values())
            dion3_elements += state["exp_avg"].numel()
    return {
        "dtypes": {k: sorted(v) for k, v in dtypes.items()},
        "bytes per element": dion3_bytes / dion3_elements,
        "state": [{k: v.clone() for k, v in state.items() if torch.is_tensor(v)} for _, state in _partitions(engine)],
        "momentum_dtype": sorted({str(group["momentum_dtype"]) for group, _ in _partitions(engine)}),
    }


def stage0_momenta(engine) -> dict[str, torch.Tensor]:
    """Stage 0's Dion3 momentum of every matrix parameter, by name."""
    opt = h._basic(engine)
    return {n: opt.state[p]["momentum"].clone() for n, p in engine.module.named_parameters() if "momentum" in opt.state[p]}


def full_momenta(engine, names: list[str]) -> dict[str, torch.Tensor]:
    """The momentum of the parameters ``names`` from the partitions, whole (DeepSpeed's accessor:
    collective, every rank in the same order)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    params = dict(engine.module.named_parameters())
    return {n: safe_get_full_optimizer_state(params[n], "exp_avg").clone() for n in sorted(names)}


def _resumed(cfg: dict, ckpt: str, tag: str, universal: bool = False):
    engine = h.make_engine({**cfg, "checkpoint": {"load_universal": True}} if universal else cfg, seed=1)
    engine.load_checkpoint(ckpt, tag=tag)
    h.train(engine, 2, start=3)
    return engine


def _mixed_group_refusal(world: int, stage: int) -> Optional[str]:
    """A DeepSpeedDion3 whose one param group holds matrices and vectors alike, with a bf16
    momentum, given to ``deepspeed.initialize`` at ``stage``: the message it fails with, or None."""
    from dion3_megatron.deepspeed import DeepSpeedDion3

    torch.manual_seed(0)
    model = h.Net()
    cfg = {k: v for k, v in h.config(stage, world=world).items() if k != "optimizer"}
    try:
        h.deepspeed.initialize(
            model=model, optimizer=DeepSpeedDion3([{"params": list(model.parameters())}], momentum_dtype="bf16"), config=cfg
        )
    except ValueError as e:
        return str(e)
    return None


def session(rank: int, world: int, tmp: str) -> dict:
    h.init()
    out: dict[str, Any] = {}
    # Every stage with a bf16 momentum, and ZeRO-1 with an fp32 one (the state bytes' reference).
    runs = {}
    for name, cfg in [*((f"s{stage}", config(stage, world)) for stage in range(4)), ("s1 fp32", config(1, world, momentum_dtype="fp32"))]:
        engine = h.make_engine(cfg)
        h.train(engine, STEPS)
        runs[name] = engine
    params = {name: h.params_of(engine) for name, engine in runs.items()}
    out["moved"] = h.max_diff(params["s0"], h.params_of(h.make_engine(config(0, world))))
    out["diff"] = {name: h.max_diff(params[name], params["s0"]) for name in ("s1", "s2", "s3")}
    out["bf16 vs fp32"] = h.max_diff(params["s1"], params["s1 fp32"])
    out["state"] = {name: {k: v for k, v in state_of(engine).items() if k != "state"} for name, engine in runs.items() if name != "s0"}
    out["stage0 momentum dtypes"] = sorted({str(m.dtype) for m in stage0_momenta(runs["s0"]).values()})
    expected = stage0_momenta(runs["s0"])
    out["momentum vs stage 0"] = {}
    for name in ("s1", "s2", "s3"):
        got = full_momenta(runs[name], list(expected))
        out["momentum vs stage 0"][name] = {n: (got[n].float() - expected[n].float()).abs().max().item() for n in expected}
    del runs

    # ZeRO-2 and ZeRO-3 saved after 3 steps: resumed at the same stage; converted to universal
    # checkpoints, resumed (ZeRO-2's at ZeRO-1) with a bf16 momentum and under an fp32 config.
    targets = {}
    for stage in (2, 3):
        ckpt = os.path.join(tmp, f"zero{stage}")
        engine = h.make_engine(config(stage, world))
        h.train(engine, 3)
        engine.save_checkpoint(ckpt, tag="step3", client_state=h.dion3_ckpt.universal_checkpoint_info())
        h.train(engine, 2, start=3)
        targets[stage] = (h.params_of(engine), state_of(engine)["state"])
        resumed = _resumed(config(stage, world), ckpt, "step3")
        got = state_of(resumed)["state"]
        out[f"zero{stage} resume"] = {
            "params equal": all(torch.equal(v, targets[stage][0][n]) for n, v in h.params_of(resumed).items()),
            "state equal": all(torch.equal(v, b[k]) for a, b in zip(got, targets[stage][1]) for k, v in a.items()),
        }
    if rank == 0:
        for stage in (2, 3):
            ckpt = os.path.join(tmp, f"zero{stage}")
            h.dion3_ckpt.convert_to_universal(os.path.join(ckpt, "step3"), os.path.join(ckpt, "step3_universal"))
    dist.barrier()
    out["universal"], out["universal into fp32"] = {}, {}
    for saved, stage in ((2, 1), (3, 3)):  # (DeepSpeed's ZeRO-3 loads universal checkpoints of ZeRO-3 only)
        folder, case = os.path.join(tmp, f"zero{saved}"), f"zero{saved} to zero{stage}"
        resumed = _resumed(config(stage, world), folder, "step3_universal", universal=True)
        state = state_of(resumed)
        out["universal"][case] = {
            "diff": h.max_diff(h.params_of(resumed), targets[saved][0]),
            "dtypes": state["dtypes"],
            "momentum_dtype": state["momentum_dtype"],
        }
        fp32 = state_of(_resumed(config(stage, world, momentum_dtype="fp32"), folder, "step3_universal", universal=True))
        out["universal into fp32"][case] = {k: v for k, v in fp32.items() if k in ("dtypes", "momentum_dtype")}

    out["mixed group"] = {stage: _mixed_group_refusal(world, stage) for stage in (0, 1)}
    out["switched to bf16"] = _switched_to_bf16(world, list(expected))
    return out


def _switched_to_bf16(world: int, names: list[str]) -> dict[str, Any]:
    """ZeRO-1 with an fp32 momentum for two steps, then ``momentum_dtype`` set to "bf16" in every
    param group: the dtypes of the partitions' ``exp_avg`` after the next step, and whether
    DeepSpeed's accessor then reads the momentum the steps write (bf16 values that a further step
    changes) rather than the fp32 tensor the conversion replaced."""
    engine = h.make_engine(config(1, world, momentum_dtype="fp32"))
    h.train(engine, 2)
    for group in h._basic(engine).param_groups:
        group["momentum_dtype"] = "bf16"
    h.train(engine, 1, start=2)
    before = full_momenta(engine, names)
    h.train(engine, 1, start=3)
    after = full_momenta(engine, names)
    return {
        "dtypes": state_of(engine)["dtypes"],
        "bf16 values": all(torch.equal(m, m.bfloat16().float()) for m in after.values()),
        "moved": all(not torch.equal(before[n], after[n]) for n in names),
    }
