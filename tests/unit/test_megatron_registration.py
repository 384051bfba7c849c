"""Registration of ``--optimizer dion3``: registry entry, argparse flags, launcher, source patch (all through
dion3_megatron.megatron.register; what it changes: tests/unit/test_compat.py)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
from support.readme import readme_megatron_commands
from support import repository

from dion3_megatron import options

pytest.importorskip("megatron.core")

REPO = str(repository.ROOT)
PATCH = os.path.join(REPO, "patches", "megatron-core-0.19-dion3.patch")
GOOD = ["--optimizer", "dion3", "--dion3-fraction", "0.125"]


def _megatron_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_register_is_idempotent_and_fills_the_registry():
    import dion3_megatron.megatron as dm
    from megatron.core import optimizer as core_optimizer
    from megatron.core.optimizer import emerging_optimizers as eo

    entry = eo._EMERGING_OPTIMIZERS["dion3"]
    from dion3_megatron import compat

    factory = core_optimizer._get_megatron_emerging_optimizer
    for _ in range(3):
        assert dm.register() is True  # megatron.training is importable here
    assert eo._EMERGING_OPTIMIZERS["dion3"] is entry
    assert core_optimizer._get_megatron_emerging_optimizer is factory  # not wrapped twice
    assert compat.is_patched(factory) and not compat.is_patched(factory.__wrapped__)
    assert entry.optimizer_cls is dm.MegatronDion3
    assert entry.config_to_kwargs is dm.config_to_kwargs and entry.init_state_fn is dm.init_state_fn
    # Embeddings / output layer / non-2-D params go to Megatron's Adam, as for Muon.
    (override,) = entry.default_param_overrides.values()
    assert override == {"optimizer": "adam"}
    # Other optimizers keep Megatron's own emerging-optimizers check.
    assert core_optimizer.HAVE_EMERGING_OPTIMIZERS in (True, False)


def test_registered_parser_accepts_dion3_flags():
    import dion3_megatron.megatron  # noqa: F401

    args = _megatron_parser().parse_args(
        GOOD
        + [
            "--dion3-ns-method",
            "standard",
            "--dion3-no-scale-lr-by-fraction",
            "--dion3-adjust-lr",
            "rms_norm",
            "--dion3-scale-mu-by-fraction",
            "--dion3-no-cuda-graph",
        ]
    )
    assert args.optimizer == "dion3"
    assert args.dion3_fraction == 0.125
    assert args.dion3_ns_method == "standard"
    assert args.dion3_scale_lr_by_fraction is False and args.dion3_adjust_lr == "rms_norm"
    assert args.dion3_scale_mu_by_fraction is True and args.dion3_cuda_graph is False
    assert _megatron_parser().parse_args(["--optimizer", "dion3", "--dion3-fraction", "auto"]).dion3_fraction == "auto"
    defaults = _megatron_parser().parse_args([])
    assert (defaults.dion3_fraction, defaults.dion3_mu, defaults.dion3_beta2) == ("auto", None, 0.95)
    assert defaults.dion3_split_qkv and defaults.dion3_split_glu and defaults.dion3_cuda_graph
    assert defaults.dion3_scale_mu_by_fraction is False and defaults.dion3_scale_lr_by_fraction is True


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dion3-fraction", "1.5"], "argument --dion3-fraction: fraction must be in (0, 1] or 'auto', got 1.5"),
        (["--dion3-fraction", "0"], "argument --dion3-fraction: fraction must be in (0, 1] or 'auto', got 0.0"),
        (["--dion3-fraction", "quarter"], "argument --dion3-fraction: fraction must be in (0, 1] or 'auto', got 'quarter'"),
        (["--dion3-mu", "1.0"], "argument --dion3-mu: mu must be in [0, 1), got 1.0"),
        (["--dion3-ns-method", "cubic"], "argument --dion3-ns-method: invalid choice: 'cubic'"),
        (["--optimizer", "dion4"], "--optimizer dion4: did you mean dion3?"),
        (["--optimizer", "adamw"], "argument --optimizer: invalid choice: 'adamw'"),
    ],
)
def test_bad_flag_values_get_argparse_errors(flags, message, capsys):
    import dion3_megatron.megatron  # noqa: F401

    with pytest.raises(SystemExit) as exc:
        _megatron_parser().parse_args(["--optimizer", "dion3"] + flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_reach_the_optimizer_config_and_kwargs():
    import torch

    import dion3_megatron.megatron as dm
    from megatron.training import training

    args = _megatron_parser().parse_args(GOOD + ["--dion3-mu", "0.9", "--lr", "0.03"])
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        setattr(args, name, torch.float32)  # what validate_args would convert them to
    with pytest.warns(UserWarning, match=r"--lr 0.03 without --decoupled-lr.*pass --decoupled-lr"):
        config, _ = training.get_megatron_optimizer_config(args)
    assert config.optimizer == "dion3" and config.dion3_fraction == 0.125 and config.dion3_mu == 0.9
    args.decoupled_lr = 0.002
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        training.get_megatron_optimizer_config(args)
    kwargs = dm.config_to_kwargs(config, [], None)
    assert kwargs["fraction"] == 0.125 and kwargs["mu"] == 0.9 and kwargs["lr"] == 0.03
    assert kwargs["ns_method"] == "gram" and "selection_scope" not in kwargs


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("dion3_cuda_graph", "false", "a bool"),
        ("dion3_split_qkv", "false", "a bool"),
        ("dion3_split_glu", 0, "a bool"),
        ("dion3_scale_lr_by_fraction", "true", "a bool"),
        ("dion3_scale_mu_by_fraction", "False", "a bool"),
        ("dion3_mu", "0.9", "in [0, 1)"),
        ("dion3_fraction", 5, "in (0, 1] or 'auto'"),
        ("dion3_eps", float("inf"), "a finite number > 0"),
        ("dion3_ns_method", "svd", "one of ('gram', 'standard')"),
    ],
)
def test_config_values_of_the_wrong_type_are_refused_by_name(key, value, expected):
    from types import SimpleNamespace

    import dion3_megatron.megatron as dm

    config = SimpleNamespace(lr=0.01, weight_decay=0.1, **{key: value})
    with pytest.raises(ValueError) as info:
        dm.config_to_kwargs(config, [], None)
    assert f"{key} must be {expected}, got {value!r}" in str(info.value)


def test_scaling_an_unset_mu_is_refused_by_name():
    from types import SimpleNamespace

    import dion3_megatron.megatron as dm

    config = SimpleNamespace(lr=0.01, weight_decay=0.1, dion3_scale_mu_by_fraction=True)
    with pytest.raises(ValueError, match="dion3_scale_mu_by_fraction=True scales an explicit dion3_mu, got dion3_mu=None"):
        dm.config_to_kwargs(config, [], None)
    assert (
        dm.config_to_kwargs(SimpleNamespace(lr=0.01, weight_decay=0.1, dion3_scale_mu_by_fraction=True, dion3_mu=0.88), [], None)["mu"]
        == 0.88
    )


_LAUNCHED = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from megatron.training.arguments import parse_args
    args = parse_args()
    dist.init_process_group("gloo")  # env://, as Megatron-LM's initialize_megatron does
    print("LAUNCHED", __name__, sys.argv[1:], args.optimizer, args.dion3_fraction, "world", dist.get_world_size())
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_launcher_runs_a_megatron_script_with_dion3_registered(tmp_path):
    script = tmp_path / "pretrain_tiny.py"
    script.write_text(_LAUNCHED)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run(
        [sys.executable, "-m", "dion3_megatron.megatron.launch", str(script), *GOOD],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"LAUNCHED __main__ {GOOD!r} dion3 0.125 world 1" in out.stdout


@pytest.mark.slow
def test_registration_mends_torch_adams_resume_where_megatron_falls_back_to_it():
    """Without apex or Transformer Engine (this machine, and a pip install on a GPU) Megatron's Adam
    is torch's AdamW, whose DistributedOptimizer resume the library mends on registration, for Dion3
    runs (the resume itself: tests/integration/test_megatron_pretrain.py; other runs:
    test_registration_leaves_another_optimizers_run_byte_identical). A fresh interpreter, no CPU shim."""
    check = textwrap.dedent("""
        import torch
        from megatron.core import optimizer as core_optimizer
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO
        before = (DO.state_dict, DO.load_state_dict, DO._set_main_param_and_optimizer_states)
        import dion3_megatron.megatron
        from dion3_megatron import compat
        after = (DO.state_dict, DO.load_state_dict, DO._set_main_param_and_optimizer_states)
        print(core_optimizer.Adam is torch.optim.AdamW, all(compat.is_patched(a) and a.__wrapped__ is b
                                                            for a, b in zip(after, before)))
    """)
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True"], out.stdout


def test_launcher_checks_the_dion3_values_first_and_leaves_other_optimizers_lr_alone(monkeypatch, capsys):
    from dion3_megatron.megatron.launch import check_arguments

    monkeypatch.delenv("RANK", raising=False)
    check_arguments(["--optimizer", "adam", "--lr", "-1"])  # Megatron's Adam: Megatron's to check
    check_arguments(["--optimizer", "dion3", "--lr", "0.01", "--lr-decay-style", "cosine", "--num-layers", "4"])
    with pytest.raises(SystemExit) as exit_info:
        check_arguments(["--num-layers", "4", "--optimizer=dion3", "--weight-decay", "-1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "python -m dion3_megatron.megatron.launch: error: argument --weight-decay: weight_decay must be a finite number >= 0, got -1.0\n"
    )
    monkeypatch.setenv("RANK", "1")  # torchrun's other ranks exit alike, silently
    with pytest.raises(SystemExit):
        check_arguments(["--dion3-fraction", "0"])
    assert capsys.readouterr().err == ""


def test_launcher_without_torchrun_gives_a_one_process_world_and_leaves_torchruns_alone():
    from dion3_megatron.megatron.launch import single_process_world

    plain = {}
    single_process_world(plain)
    assert (plain["RANK"], plain["WORLD_SIZE"], plain["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert 0 < int(plain["MASTER_PORT"]) < 65536
    torchrun = dict(RANK="3", WORLD_SIZE="8", MASTER_ADDR="node7", MASTER_PORT="29500")
    single_process_world(torchrun)
    assert torchrun == dict(RANK="3", WORLD_SIZE="8", MASTER_ADDR="node7", MASTER_PORT="29500")


_PATCHED_CHECK = textwrap.dedent(
    """
    import os, sys, tempfile
    import torch
    sys.path[:0] = [{repo!r}, {tests!r}]  # the repository (examples/) and tests/ (support/)
    import megatron.core
    assert megatron.core.__file__.startswith({tree!r}), megatron.core.__file__
    from megatron.training import arguments
    import megatron.core.optimizer as core_optimizer
    from megatron.core.optimizer import emerging_optimizers
    assert "dion3_megatron.megatron" not in sys.modules and "dion3" not in emerging_optimizers._EMERGING_OPTIMIZERS
    # parse_args() registers Dion3 first: --optimizer dion3 and the --dion3-* flags parse.
    sys.argv = ["pretrain_gpt.py"] + {good!r}
    args = arguments.parse_args()
    assert (args.optimizer, args.dion3_fraction) == ("dion3", 0.125), args
    from dion3_megatron import compat
    assert "dion3" in emerging_optimizers._EMERGING_OPTIMIZERS
    assert compat.is_patched(core_optimizer._get_megatron_emerging_optimizer)
    from megatron.training.training import get_megatron_optimizer_config
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        setattr(args, name, torch.float32)  # what validate_args would convert them to
    config, _ = get_megatron_optimizer_config(args)
    assert config.dion3_fraction == 0.125

    # Build and step the optimizer from the patched tree (1 process, gloo, fp32, layer-wise).
    import torch.distributed as dist
    from support import megatron_shim as ms
    ms.install()
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    ms.init_parallel()
    cfg = ms.tiny_config()
    ref = ms.Reference(cfg)
    chunks, opt, sched = ms.make_parallel(cfg, ref.state())
    before = {{n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}}
    ms.train_step(chunks, opt, sched, ms.batches(1, 2)[0])
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in chunks[0].module.named_parameters())
    assert moved > 1e-3, moved
    # Registration applied the no-apex/TE fixes too.
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from dion3_megatron.megatron import torch_adam
    assert compat.is_patched(clip_grads.l2_norm_impl), clip_grads.l2_norm_impl
    assert compat.is_patched(DistributedOptimizer.state_dict) == torch_adam.megatron_adam_is_torch()

    # pretrain()'s model-config path wraps a Dion3 run's model in the layer-wise layout.
    from types import SimpleNamespace
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import global_vars
    from megatron.training.models import dist_utils
    assert compat.is_patched(dist_utils._ddp_wrap)
    global_vars._GLOBAL_ARGS = SimpleNamespace(optimizer="dion3", use_layer_wise_distributed_optimizer=True,
                                               use_layer_wise_param_layout=True)
    (chunk,) = dist_utils._ddp_wrap([ms.build_gpt(cfg)], False, DistributedDataParallelConfig(), False,
                                    pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    assert chunk.ddp_config.use_distributed_optimizer
    managed = {{n for n, p in chunk.module.named_parameters() if p.is_managed_by_layer_wise_optimizer}}
    assert managed and all("layers" in n for n in managed), managed
    global_vars._GLOBAL_ARGS = None
    dist.destroy_process_group()
    print("PATCHED_OK")
    """
)

# Megatron-Core alone: get_megatron_optimizer() registers Dion3 first (it then fails on the empty
# model list, after registering).
_PATCHED_CORE_CHECK = textwrap.dedent(
    """
    import sys
    import megatron.core
    assert megatron.core.__file__.startswith({tree!r}), megatron.core.__file__
    from megatron.core.optimizer import OptimizerConfig, emerging_optimizers, get_megatron_optimizer
    assert "dion3_megatron.megatron" not in sys.modules and "dion3" not in emerging_optimizers._EMERGING_OPTIMIZERS
    try:
        get_megatron_optimizer(OptimizerConfig(optimizer="dion3"), [])
    except IndexError:
        pass
    assert "dion3" in emerging_optimizers._EMERGING_OPTIMIZERS
    print("PATCHED_OK")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("patch") is None and shutil.which("git") is None, reason="needs patch or git")
def test_patch_applies_to_installed_megatron_and_the_patched_tree_registers_dion3(tmp_path):
    import megatron.core

    installed = os.path.dirname(os.path.dirname(os.path.dirname(megatron.core.__file__)))
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(installed, "megatron"), tree / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    if shutil.which("patch"):
        with open(PATCH) as patch_file:
            applied = subprocess.run(["patch", "-p1", "--forward", "--batch"], stdin=patch_file, cwd=tree, capture_output=True, text=True)
    else:  # git apply works outside a repository too
        applied = subprocess.run(["git", "apply", "-p1", PATCH], cwd=tree, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "FAILED" not in applied.stdout and "fuzz" not in applied.stdout, applied.stdout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    for check in (
        _PATCHED_CHECK.format(repo=REPO, tests=os.path.join(REPO, "tests"), tree=str(tree), good=GOOD),
        _PATCHED_CORE_CHECK.format(tree=str(tree)),
    ):
        out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
        assert out.returncode == 0 and "PATCHED_OK" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])


def test_megatron_help_survives_its_bare_percent_and_lists_the_dion3_flags():
    """megatron-core 0.19.2's parser cannot print its own --help (a help string ends "1.10 = 10%)."):
    the parser dion3 extends can, with the Dion3 group and its defaults."""
    import dion3_megatron.megatron  # noqa: F401

    text = _megatron_parser().format_help()
    assert "(e.g. 1.10 = 10%)" in " ".join(text.split())
    assert "Dion3 optimizer (--optimizer dion3):" in text
    assert "(default: auto)" in " ".join(text.split())


def test_launcher_help_lists_every_dion3_flag_with_its_default():
    from dion3_megatron import options
    from dion3_megatron.megatron import arguments, launch

    text = launch.help_parser().format_help()
    lines = text.splitlines()
    assert lines[0].startswith("usage: python -m dion3_megatron.megatron.launch [-h] SCRIPT [SCRIPT ARGS ...]")
    assert "pretrain_gpt.py comes with Megatron-LM (the megatron-core wheel has none)" in " ".join(text.split())
    flat = " ".join(text.split())
    for option in options.options_for(options.MEGATRON):
        assert arguments.flag(option.name) in text, option.name
    for shown in (
        "(default: auto)",
        "(default: unset)",
        "(default: 0.95)",
        "(default: 1e-08)",
        "(default: spectral_norm)",
        "(default: gram)",
        "(default: off)",
        "Turn off (on by default)",
    ):
        assert shown in flat, shown
    for markup in ("``", ":func:", ":mod:", ":class:", ":data:"):
        assert markup not in text, markup


@pytest.mark.slow
def test_launcher_help_prints_without_importing_megatron():
    """The launcher's --help: usage and flags first, no Megatron import and none of its warnings;
    no script: the usage and exit status 2."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-W", "default", "-m", "dion3_megatron.megatron.launch", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m dion3_megatron.megatron.launch"), out.stdout[:300]
    assert "--dion3-fraction FRACTION" in out.stdout and "--dion3-no-split-glu" in out.stdout
    assert out.stderr == "", out.stderr[:2000]
    out = subprocess.run([sys.executable, "-m", "dion3_megatron.megatron.launch"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stderr.startswith("usage: python -m dion3_megatron.megatron.launch"), out
    assert "error: the training script is missing" in out.stderr


@pytest.mark.slow
def test_script_help_through_the_launcher_prints_megatrons_flags_and_dion3s(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    script = os.path.join(REPO, "examples", "megatron_lm_pretrain_gpt.py")
    out = subprocess.run(
        [sys.executable, "-m", "dion3_megatron.megatron.launch", script, "--help"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--moe-paged-stash-buffer-size-factor-cuda" in out.stdout and "--use-distributed-optimizer" in out.stdout
    assert "Dion3 optimizer (--optimizer dion3):" in out.stdout and "--dion3-fraction" in out.stdout


def test_examples_extra_brings_what_megatrons_muon_imports():
    """`pip install .[examples]` brings emerging-optimizers and absl-py (Megatron's --optimizer muon,
    which the examples' comparisons run, imports both), and nothing named apex (the PyPI package of
    that name is not NVIDIA's)."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    examples = {Requirement(r).name: Requirement(r) for r in extras["examples"]}
    assert {"megatron-core", "emerging-optimizers", "absl-py"} <= set(examples)
    assert not any("apex" in Requirement(r).name for requirements in extras.values() for r in requirements)
    for name in ("megatron-core", "emerging-optimizers", "absl-py"):  # what this environment runs
        assert examples[name].specifier.contains(importlib.metadata.version(name)), name
    from megatron.core.optimizer import emerging_optimizers

    assert emerging_optimizers.HAVE_EMERGING_OPTIMIZERS and "muon" in emerging_optimizers._EMERGING_OPTIMIZERS


def test_readme_megatron_commands_parse():
    """Both README commands (Megatron-LM's pretrain_gpt.py, ours) are valid Megatron-LM arguments with
    Dion3 registered (tests/integration/test_megatron_pretrain.py runs ours on CPU)."""
    import dion3_megatron.megatron  # noqa: F401

    commands = readme_megatron_commands()
    assert sorted(commands) == ["Megatron-LM/pretrain_gpt.py", "examples/megatron_lm_pretrain_gpt.py"]
    assert os.path.isfile(os.path.join(REPO, "examples", "megatron_lm_pretrain_gpt.py"))
    for script, argv in commands.items():
        args = _megatron_parser().parse_args(argv)
        assert (args.optimizer, args.dion3_fraction, args.use_distributed_optimizer) == ("dion3", "auto", True), script


def test_an_unknown_dion3_attribute_of_the_config_or_the_args_is_refused_with_the_hint(monkeypatch):
    from types import SimpleNamespace

    from megatron.core.optimizer import OptimizerConfig
    from megatron.training import global_vars

    import dion3_megatron.megatron as dm

    config = OptimizerConfig(optimizer="dion3", lr=0.01)
    config.dion3_fractoin = 0.25
    with pytest.raises(
        options.UnknownOptionError,
        match=r"^Megatron optimizer config: unknown attribute dion3_fractoin; "
        r"did you mean 'dion3_fraction'\?$",
    ):
        dm.config_to_kwargs(config, [], None)
    del config.dion3_fractoin
    config.dion3_xyz = 1
    with pytest.raises(options.UnknownOptionError, match=r"unknown attribute dion3_xyz; the Dion3 fields are dion3_fraction, dion3_mu"):
        dm.config_to_kwargs(config, [], None)
    del config.dion3_xyz
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", SimpleNamespace(dion3_momentum=0.9))
    with pytest.raises(
        options.UnknownOptionError,
        match=r"^Megatron-LM args: unknown attribute dion3_momentum; "
        r"Dion3 calls its momentum 'dion3_mu'$",
    ):
        dm.config_to_kwargs(config, [], None)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", SimpleNamespace(dion3_mu=0.9))
    assert dm.config_to_kwargs(config, [], None)["mu"] == 0.9


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--dion3-momentum", "0.9"], "--dion3-momentum: unknown flag; Dion3 calls its momentum --dion3-mu"),
        (["--dion3-fractoin=0.25"], "--dion3-fractoin: unknown flag; did you mean --dion3-fraction?"),
        (["--dion3-cuda-graph"], "--dion3-cuda-graph: unknown flag; did you mean --dion3-no-cuda-graph?"),
        (["--optimizer", "Dion3"], "--optimizer Dion3: did you mean dion3?"),
        (["--optimizer", "dion"], "--optimizer dion: did you mean dion3?"),
        (["--dion3-fraction", "1.5"], "argument --dion3-fraction: fraction must be in (0, 1] or 'auto', got 1.5"),
    ],
)
def test_a_mistake_in_a_dion3_flag_stops_megatron_s_parser_with_one_line(flags, line, capsys, monkeypatch):
    import dion3_megatron.megatron  # noqa: F401

    monkeypatch.delenv("RANK", raising=False)
    for parse in ("parse_args", "parse_known_args"):  # (Megatron's ignore_unknown_args parses known args only)
        parser = _megatron_parser()
        with pytest.raises(SystemExit) as exc:
            getattr(parser, parse)(["--num-layers", "2"] + flags)
        assert exc.value.code == 2
        assert capsys.readouterr().err == f"{parser.prog}: error: {line}\n"
    with pytest.raises(SystemExit):  # Megatron's own mistakes keep argparse's usage
        _megatron_parser().parse_args(["--num-layerz", "2"])
    assert capsys.readouterr().err.startswith("usage:")


def test_the_launcher_stops_an_unknown_dion3_flag_before_the_script_starts(capsys, monkeypatch):
    from dion3_megatron.megatron.launch import PROG, check_arguments

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        check_arguments(["--optimizer", "dion3", "--dion3-momentum", "0.9", "--num-layers", "4"])
    assert capsys.readouterr().err == f"{PROG}: error: --dion3-momentum: unknown flag; Dion3 calls its momentum --dion3-mu\n"


@pytest.mark.slow
def test_without_megatron_the_import_and_the_main_job_name_the_extra(tmp_path):
    """Megatron hidden from every process (a sitecustomize that blocks the import)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['megatron'] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    for command in (["-c", "import dion3_megatron.megatron"], [os.path.join(REPO, "examples", "pretrain_gpt.py"), "--steps", "1"]):
        out = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode != 0
        assert out.stderr.strip().splitlines()[-1] == (
            'ImportError: dion3_megatron.megatron needs Megatron-Core 0.19, which is not installed: pip install "dion3-megatron[megatron]"'
        ), out.stderr[-2000:]


# Megatron's Adam (torch AdamW here: no apex, no Transformer Engine) with the distributed optimizer
# and clipping, one process: 3 steps, a torch_dist save, 1 step, a load (which stock 0.19 refuses
# for torch's AdamW), 1 step. Once with stock Megatron, once with Dion3 registered: everything,
# the errors included, must be the same bytes.
_ADAM_RUN = textwrap.dedent(
    """
    import json, os, sys, tempfile
    import torch
    import torch.distributed as dist
    sys.path[:0] = [{repo!r}, {tests!r}]
    from support import megatron_shim as ms
    ms.install()
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training import wrap_model_chunks_with_ddp

    class NoSchedule:
        def step(self, increment):
            pass

    def build():
        ms.init_parallel()
        cfg = ms.tiny_config()
        chunks = wrap_model_chunks_with_ddp([ms.build_gpt(cfg)], cfg, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True))
        cfg.finalize_model_grads_func, cfg.no_sync_func = finalize_model_grads, chunks[0].no_sync
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.1, clip_grad=0.5,
                                                     use_distributed_optimizer=True, **ms.ADAM), chunks)
        return chunks, opt

    def sharded(chunks, opt, loading):
        metadata = {{"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}}
        sd = {{"model": chunks[0].module.sharded_state_dict(metadata=metadata)}}
        sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=loading, metadata=metadata)
        return sd

    def run(where):
        data = ms.batches(5, 2)
        chunks, opt = build()
        out = {{}}
        try:
            out["fresh state_dict"] = opt.state_dict()
        except Exception as error:  # stock 0.19 asserts before AdamW's first step
            out["fresh state_dict"] = type(error).__name__
        out["grad norms"] = [ms.train_step(chunks, opt, NoSchedule(), b)[2] for b in data[:3]]
        os.makedirs(where)
        dist_checkpointing.save(sharded(chunks, opt, False), where)
        out["grad norms"].append(ms.train_step(chunks, opt, NoSchedule(), data[3])[2])
        out["weights"] = {{n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}}
        chunks, opt = build()
        try:  # stock 0.19 with torch's AdamW: its fresh state_dict() asserts here too
            loaded = dist_checkpointing.load(sharded(chunks, opt, True), where)
        except Exception as error:
            out["load"] = type(error).__name__
            return out
        chunks[0].module.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        out["grad norms"] += [ms.train_step(chunks, opt, NoSchedule(), b)[2] for b in data[3:]]
        out["resumed weights"] = {{n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}}
        out["state_dict"] = opt.state_dict()
        out["state"] = {{k: v.clone() for k, v in opt.get_parameter_state_dp_reshardable().items()
                        if torch.is_tensor(v)}} if hasattr(opt, "get_parameter_state_dp_reshardable") else {{}}
        return out

    def same(a, b):
        if torch.is_tensor(a):
            return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    tmp = tempfile.mkdtemp()
    stock = run(os.path.join(tmp, "stock"))
    import dion3_megatron.megatron
    from dion3_megatron import compat
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    patched = [compat.is_patched(clip_grads.l2_norm_impl), compat.is_patched(DistributedOptimizer.load_state_dict)]
    registered = run(os.path.join(tmp, "registered"))
    print("RESULT" + json.dumps(dict(patched=patched, norms=[stock["grad norms"], registered["grad norms"]],
                                     differ=sorted(k for k in stock.keys() | registered.keys()
                                                   if not same(stock.get(k), registered.get(k))))))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_registration_leaves_another_optimizers_run_byte_identical():
    """Registration replaces Megatron's Adam checkpoint methods and its multi-tensor loops (without
    apex or Transformer Engine); a run whose optimizer is not dion3 must not see it."""
    script = _ADAM_RUN.format(repo=REPO, tests=os.path.join(REPO, "tests"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    result = json.loads(line[len("RESULT") :])
    assert result["patched"] == [True, True]  # the replacements are in place, and fall through
    assert result["differ"] == [], result
    assert result["norms"][0] == result["norms"][1] and len(result["norms"][0]) >= 4
