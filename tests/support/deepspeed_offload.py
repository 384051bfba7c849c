"""DeepSpeed's optimizer offload for Dion3 on CPU (gloo), for tests/integration/test_deepspeed_offload.py:
``"offload_optimizer": {"device": "cpu"}`` at ZeRO 1, 2 and 3 against the same run without it,
and with the CPU standing in for the GPU the offloaded step streams to (every copy in and out runs
as on one: dion3_megatron.engine.offload); what Dion3 cannot take is refused at initialize."""

from __future__ import annotations

from typing import Any

import torch

from . import deepspeed_helpers as h
from . import deepspeed_zero3


def offloaded(cfg: dict, **offload: Any) -> dict:
    """``cfg`` with ZeRO's ``offload_optimizer`` (to the CPU unless ``offload`` says otherwise)."""
    return {**cfg, "zero_optimization": {**cfg["zero_optimization"], "offload_optimizer": {"device": "cpu", **offload}}}


def stage_config(stage: int, world: int, **params: Any) -> dict:
    # No clipping: ZeRO-Offload measures the norm on the host, in another order than on the device.
    cfg = deepspeed_zero3.zero3_config(world, **params) if stage == 3 else h.config(stage, world=world, **params)
    cfg["gradient_clipping"] = 0.0
    return cfg


def make(cfg: dict, stage: int):
    return deepspeed_zero3.make(cfg) if stage == 3 else h.make_engine(cfg, groups=True)


def run(cfg: dict, stage: int, steps: int = 3) -> dict:
    """Train ``steps`` steps: the parameters, the optimizer's state (its tensors, on the host) and
    the class and offload flag of Dion3."""
    engine = make(cfg, stage)
    h.train(engine, steps)
    opt = h._basic(engine)
    state = {key: value.clone() for s in opt.state.values() for key, value in s.items() if torch.is_tensor(value) and value.dim()}
    return {
        "params": h.params_of(engine),
        "state": state,
        "class": type(opt).__name__,
        "offload": opt.offload,
        "engine_offload": str(opt._session.engine.offload) if getattr(opt, "_session", None) and opt._session.engine else None,
        "state_devices": sorted({str(v.device) for v in state.values()}),
    }


def compare(a: dict, b: dict) -> dict:
    return {
        "params": h.max_diff(a["params"], b["params"]),
        "state": max((a["state"][k] - b["state"][k]).abs().max().item() for k in a["state"])
        if a["state"].keys() == b["state"].keys()
        else None,
    }


def session_two_ranks(rank: int, world: int) -> dict:
    h.init()
    from dion3_megatron.engine import offload as engine_offload

    out: dict[str, Any] = {"stages": {}}
    for stage in (1, 2, 3):
        cfg = stage_config(stage, world)
        plain = run(cfg, stage)
        with_offload = run(offloaded(cfg), stage)
        # The CPU as the GPU the step streams to: the partitions, their gradients and state travel.
        step_device = engine_offload.step_device
        engine_offload.step_device = lambda on, device: torch.device("cpu") if on else None
        try:
            streamed = run(offloaded(cfg), stage)
        finally:
            engine_offload.step_device = step_device
        initial = h.params_of(make(cfg, stage))
        out["stages"][stage] = {
            "moved": h.max_diff(plain["params"], initial),
            "offload": compare(plain, with_offload),
            "streamed": compare(plain, streamed),
            "flags": (plain["offload"], with_offload["offload"], streamed["offload"]),
            "engines": (plain["engine_offload"], with_offload["engine_offload"], streamed["engine_offload"]),
            "class": with_offload["class"],
        }
    # ZeRO-0: Dion3's own "offload" (no GPU: nothing to stream to, the step as without it).
    cfg = h.config(0, world=world, clip=0.0)
    stage0 = h.make_engine(
        {**cfg, "optimizer": {**cfg["optimizer"], "params": {**cfg["optimizer"]["params"], "offload": True}}}, groups=True
    )
    h.train(stage0, 3)
    reference = h.make_engine(cfg, groups=True)
    h.train(reference, 3)
    out["stage0"] = {"diff": h.max_diff(h.params_of(stage0), h.params_of(reference)), "offload": h._basic(stage0).offload}
    # Dion3 handed to deepspeed.initialize as an object: DeepSpeed asks "zero_force_ds_cpu_optimizer": false.
    from dion3_megatron.deepspeed import DeepSpeedDion3, param_groups

    torch.manual_seed(0)
    model = h.Net()
    client = DeepSpeedDion3(param_groups(model), **cfg["optimizer"]["params"])
    client_cfg = {k: v for k, v in offloaded(stage_config(2, world)).items() if k != "optimizer"}
    engine, *_ = h.deepspeed.initialize(model=model, optimizer=client, config={**client_cfg, "zero_force_ds_cpu_optimizer": False})
    h.train(engine, 3)
    out["client"] = {"diff": h.max_diff(h.params_of(engine), run(stage_config(2, world), 2)["params"]), "offload": h._basic(engine).offload}
    # What Dion3 cannot take is refused at initialize, in one line naming what to set.
    own = stage_config(2, world, offload=True)
    out["errors"] = {
        "nvme": h.init_error(offloaded(stage_config(2, world), device="nvme", nvme_path="/tmp")),
        "ratio": _zero3_error(offloaded(stage_config(3, world), ratio=0.5)),
        "own_offload_under_zero": h.init_error(own),
    }
    return out


def _zero3_error(cfg: dict) -> str | None:
    try:
        deepspeed_zero3.make(cfg)
    except (ValueError, TypeError) as e:
        return str(e)
    return None
