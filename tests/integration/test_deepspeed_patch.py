"""patches/deepspeed-0.19-dion3.patch applies to DeepSpeed 0.19 and makes deepspeed.initialize register Dion3
(dion3_megatron.deepspeed.register, the entry point of the import): a config's "type": "Dion3" works in a
script that never imports dion3_megatron."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import importlib.util

import pytest
from support.dist_utils import free_port
from support.repository import ROOT

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs deepspeed", allow_module_level=True)

PATCH = ROOT / "patches" / "deepspeed-0.19-dion3.patch"

SCRIPT = textwrap.dedent(
    """
    import importlib, json, os, sys
    import torch, deepspeed
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    assert "dion3_megatron.deepspeed" not in sys.modules
    assert deepspeed.__file__.startswith(sys.argv[1]), deepspeed.__file__
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    def build(**kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3))
        cfg = {"train_micro_batch_size_per_gpu": 2,
               "optimizer": {"type": "Dion3", "params": {"lr": 0.05, **kw.pop("params", {})}},
               "zero_optimization": {"stage": kw.pop("stage", 1)}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    engine = build()
    out["registered"] = "dion3_megatron.deepspeed" in sys.modules
    out["name"] = engine.optimizer_name()
    out["basic"] = type(engine.basic_optimizer).__name__
    out["algorithms"] = [g["algorithm"] for g in engine.basic_optimizer.param_groups]
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine(torch.randn(2, 6)).square().mean()
    engine.backward(loss); engine.step()
    out["moved"] = max((p - b).abs().max().item() for p, b in zip(engine.module.parameters(), before))
    try:
        build(params={"momentum": 0.9}); out["unknown"] = None
    except TypeError as e:  # (dion3_megatron.options.UnknownOptionError, as for every unknown name)
        out["unknown"] = str(e)
    engine = build(stage=3)
    out["stage3_basic"] = type(engine.optimizer.optimizer).__name__
    loss = engine(torch.randn(2, 6)).square().mean()
    engine.backward(loss); engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        out["stage3_finite"] = all(torch.isfinite(p).all().item() for p in engine.module.parameters())
    out["stage3_steps"] = engine.global_steps
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    src = pathlib.Path(importlib.util.find_spec("deepspeed").origin).parent
    root = tmp_path_factory.mktemp("patched_deepspeed")
    shutil.copytree(src, root / "deepspeed", ignore=shutil.ignore_patterns("__pycache__"))
    if shutil.which("patch"):
        command = ["patch", "-p1", "--forward", "-i", str(PATCH)]
    elif shutil.which("git"):
        command = ["git", "apply", "-p1", str(PATCH)]
    else:
        pytest.skip("needs patch or git")
    result = subprocess.run(command, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return root


@pytest.mark.slow
def test_patch_applies_cleanly_and_is_not_yet_applied_upstream(patched):
    call = "dion3_megatron.deepspeed.register()"
    assert call in (patched / "deepspeed" / "__init__.py").read_text()
    assert call not in (pathlib.Path(importlib.util.find_spec("deepspeed").origin).parent / "__init__.py").read_text()


@pytest.mark.slow
def test_patched_deepspeed_builds_dion3_from_a_script_that_does_not_import_it(patched):
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        PYTHONPATH=f"{patched}{os.pathsep}{ROOT}",
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(patched)], env=env, capture_output=True, text=True, timeout=240)
    lines = [l for l in result.stdout.splitlines() if l.startswith("RESULT")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    out = json.loads(lines[0][len("RESULT") :])
    assert out["registered"] and out["name"] == "dion3"  # DeepSpeed lower-cases its own optimizers' names
    assert out["basic"] == "DeepSpeedZeroDion3"  # ZeRO stage 1
    assert out["algorithms"] == ["dion3", "adamw"]  # split by module, as after the import
    assert out["moved"] > 0
    assert "'momentum'" in out["unknown"] and "'mu'" in out["unknown"]
    assert out["stage3_basic"] == "DeepSpeedZeroDion3" and out["stage3_finite"] and out["stage3_steps"] == 1
