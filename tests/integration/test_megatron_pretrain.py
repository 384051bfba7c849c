"""Megatron-LM's training loop, ``megatron.training.pretrain()``, with ``--optimizer dion3
--use-distributed-optimizer`` on 2 CPU ranks (gloo), as Megatron-LM's own pretrain_gpt.py drives it:
examples/megatron_lm_pretrain_gpt.py (the same calls, synthetic data) through the launcher, on CPU
through examples/megatron_cpu.py.

For DP=2, TP=2 and MoE at EP=2: the layout pretrain() builds (the layer-wise ZeRO-1 layout,
gradients reduce-scattered, Adam in Megatron's byte-sharded DistributedOptimizer); and a run saved
at iteration 2 (torch_dist) and resumed from there with --load ends, at iteration 4, with a
checkpoint equal, tensor for tensor (weights, Dion3's and Adam's state, Adam's step), to the
uninterrupted run's, after the same losses and gradient norms. A checkpoint saved at DP=2 resumes
at TP=2, and one saved at PP=2 at DP=2.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from typing import Callable

import pytest
from support import repository
from support.megatron_flags import LOCAL_LAYERS

pytest.importorskip("megatron.training")

pytestmark = pytest.mark.slow

ROOT = str(repository.ROOT)
SCRIPT = os.path.join(ROOT, "examples", "megatron_lm_pretrain_gpt.py")
CPU = os.path.join(ROOT, "examples", "megatron_cpu.py")

# A tiny GPT for 4 iterations; dropout off (on CPU the CUDA RNG tracker is the CPU generator, which
# the data loader also draws from, so dropout masks would not survive a resume), constant lr.
TINY = [
    "--optimizer",
    "dion3",
    "--use-distributed-optimizer",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "128",
    "--swiglu",
    "--disable-bias-linear",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--vocab-size",
    "128",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "4",
    "--lr",
    "0.01",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0.01",
    "--clip-grad",
    "1.0",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    *LOCAL_LAYERS,
    "--num-workers",
    "0",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--save-interval",
    "2",
    "--ckpt-format",
    "torch_dist",
    # Megatron's DEBUG level: the CPU runner prints Megatron's arguments only there, and the tests
    # read from that dump what reached Megatron's args.
    "--logging-level",
    "10",
]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|.*? grad norm: (\S+) \|")


def torchrun(argv: list[str], nproc: int = 2, timeout: int = 300) -> tuple[int, str]:
    """torchrun --standalone --nproc-per-node NPROC ARGV: its exit status and output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr


def on_cpu(argv: list[str], nproc: int = 2, timeout: int = 300) -> str:
    """torchrun --standalone --nproc-per-node NPROC examples/megatron_cpu.py ARGV: its output."""
    code, out = torchrun([CPU, *argv], nproc, timeout)
    assert code == 0, out[-6000:]
    return out


def assert_stopped_once_before_megatron_starts(argv: list[str], line: str) -> None:
    """ARGV on 2 ranks fails with ``line`` printed once, before Megatron parses its arguments (no
    argument dump), let alone builds a model."""
    code, out = torchrun(argv, timeout=120)
    assert code != 0
    assert out.count(line) == 1, out[-3000:]
    assert "arguments ----" not in out and "building GPT model" not in out, out[-3000:]


def pretrain(args: list[str]) -> str:
    return on_cpu([SCRIPT, *TINY, *args])


def iterations(log: str) -> dict[int, tuple[str, str]]:
    """iteration -> (the logged lm loss, grad norm), as Megatron prints them."""
    return {int(i): (loss, norm) for i, loss, norm in ITERATION.findall(log)}


def checkpoint(path: str) -> dict:
    """A torch_dist checkpoint as one flat dict (read without Megatron or a process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(path, path + ".pt")
    return torch.load(path + ".pt", weights_only=False)


def flat(tree, prefix: str = "") -> dict:
    """A nested checkpoint (torch_dcp keeps the state dicts' nesting) as {dotted path: leaf}."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict = {}
    for key, value in items:
        out.update(flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def assert_same_checkpoint(a: dict, b: dict) -> None:
    import torch

    assert sorted(a) == sorted(b)
    for key in a:
        if key.startswith(("common_state", "rng_state")):  # args, run metadata; RNG (dropout is off)
            continue
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{key}: differs by {(x.float() - y.float()).abs().max().item():.3g}"
        else:
            assert repr(x) == repr(y), f"{key}: {repr(x)[:200]} != {repr(y)[:200]}"


def assert_layer_wise_layout(log: str, buffers: list[tuple[int, int]], fraction: str) -> None:
    """The layout docs/megatron.md describes: DDP reduce-scatters into the layer-wise layout (every
    block matrix whole in one data-parallel shard: one buffer of (matrices, DP size) per entry of
    ``buffers``), Dion3 is the layer-wise optimizer."""
    for matrices, dp in buffers:
        assert f"Layerwise param layout: {matrices} params, 1 buckets, dp_size={dp}" in log
    assert "Using reduce-scatter for gradient reductions" in log
    assert "Using all-reduce for gradient reductions" not in log
    assert "Using LayerWiseDistributedOptimizer for dion3" in log
    # No apex or Transformer Engine here: Megatron's norm and clipping ran as foreach ops, and said so.
    assert "run as torch foreach ops (dion3_megatron.megatron.multi_tensor)" in log
    assert re.search(rf"dion3_fraction \.+ {re.escape(fraction)}$", log, re.M)  # the flag reached Megatron's args


# MoE: 4 experts, top 2, expert parallel over both ranks (an expert data-parallel size of 1).
MOE = [
    "--num-experts",
    "4",
    "--expert-model-parallel-size",
    "2",
    "--moe-router-topk",
    "2",
    "--moe-token-dispatcher-type",
    "allgather",
    "--moe-ffn-hidden-size",
    "64",
    "--moe-router-load-balancing-type",
    "none",
    "--moe-aux-loss-coeff",
    "0",
]
LAYOUTS = {"dp2": [], "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"], "ep2": MOE}


def dion3_layout(layout: str, fraction: str) -> list[str]:
    """The flags of a layout of LAYOUTS at a Dion3 fraction ("auto", the default, is no flag)."""
    return LAYOUTS[layout] + ([] if fraction == "auto" else ["--dion3-fraction", fraction])


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Callable[[str, str], tuple[str, str]]:
    """``saved_run(layout, fraction)``: TINY in that layout, saved; its log and the directory it
    saved in. Each run once in the module: the layout test's DP=2 run at f = 1/2 is also the run
    that the offload flags' run must repeat."""
    runs: dict[tuple[str, str], tuple[str, str]] = {}

    def run(layout: str, fraction: str) -> tuple[str, str]:
        if (layout, fraction) not in runs:
            full = str(tmp_path_factory.mktemp(f"{layout}-{fraction}") / "full")
            runs[layout, fraction] = pretrain(dion3_layout(layout, fraction) + ["--save", full]), full
        return runs[layout, fraction]

    return run


# buffers: the layer-wise buffers pretrain() logs, as (matrices, DP size). Dense: the two blocks'
# QKV, projection, fc1 and fc2 in one. MoE: their QKV, projection and router at DP=2, and each
# rank's 2 experts' fc1 and fc2 in a buffer of their own. share: the range of the share of its
# matrices "auto" logs that a rank steps; at EP=2 its own experts (2/3 of its matrices' elements)
# and about half the rest.
@pytest.mark.parametrize(
    "layout,fraction,buffers,share",
    [("dp2", "0.5", [(8, 2)], None), ("tp2", "0.5", [(8, 1)], None), ("ep2", "auto", [(6, 2), (8, 1)], (0.75, 0.92))],
    ids=["dp2-0.5", "tp2-0.5", "ep2-auto"],
)
def test_pretrain_dion3_layout_and_exact_resume(saved_run, tmp_path, layout, fraction, buffers, share):
    """No --dion3-fraction is the default, "auto": the ranks choose f at the first step, by the
    share of the matrices whose forward and backward a rank computes that it steps, and the resumed
    run steps with the choices the checkpoint holds. The MoE run is Megatron's expert parallelism
    through the same loop: the experts' Dion3 state is saved and resumed with the rest."""
    parallel = dion3_layout(layout, fraction)
    log, full = saved_run(layout, fraction)
    resumed = str(tmp_path / "resumed")
    assert_layer_wise_layout(log, buffers, fraction=fraction)
    if fraction == "auto":
        chose = re.search(r"Dion3 fraction=auto chose \(rows x cols: f\) (.*); this rank steps ([0-9.]+) of", log)
        assert chose, log[-3000:]
        assert share[0] <= float(chose.group(2)) <= share[1]
    losses = iterations(log)
    assert sorted(losses) == [1, 2, 3, 4]
    assert float(losses[4][0]) < float(losses[1][0])  # (a running mean from iteration 2 on, see below)

    log = pretrain(parallel + ["--load", full, "--ckpt-step", "2", "--save", resumed])
    assert "Loading distributed optimizer sharded state of type dp_reshardable" in log
    again = iterations(log)
    assert sorted(again) == [3, 4]
    # The first iteration after the resume logs the same loss; Megatron does not reset its loss
    # average after a run's first logged iteration, so the next logged value is a different mean.
    assert again[3] == losses[3]
    assert again[4][1] == losses[4][1]  # grad norm
    checkpoint_4 = checkpoint(os.path.join(full, "iter_0000004"))
    assert any(k.startswith("chained_1.optimizer.distributed") for k in checkpoint_4)  # Adam: DistributedOptimizer
    momentum = [k for k in checkpoint_4 if ".optimizer.state.momentum." in k]  # Dion3's state
    assert momentum and (layout != "ep2" or any(".experts." in k for k in momentum))
    assert_same_checkpoint(checkpoint_4, checkpoint(os.path.join(resumed, "iter_0000004")))


def test_readme_example_command_runs_on_cpu():
    """README's examples/megatron_lm_pretrain_gpt.py command as written (bf16, the default NullTokenizer
    and vocabulary), through the CPU runner it names, for 2 iterations instead of 100, of one
    sequence of 64 tokens (bf16 matrix products are slow on CPUs)."""
    from support.readme import readme_megatron_commands

    argv = readme_megatron_commands()["examples/megatron_lm_pretrain_gpt.py"]
    for flag, value in (("--train-iters", "2"), ("--micro-batch-size", "1"), ("--global-batch-size", "1")):
        argv[argv.index(flag) + 1] = value
    for flag in ("--seq-length", "--max-position-embeddings"):
        argv[argv.index(flag) + 1] = "64"
    # --logging-level 10: the CPU runner prints Megatron's arguments at its DEBUG level only
    log = on_cpu(["examples/megatron_lm_pretrain_gpt.py", *argv, "--log-interval", "1", "--logging-level", "10"], nproc=1)
    assert sorted(iterations(log)) == [1, 2]
    assert re.search(r"^ +vocab_size \.+ 32768$", log, re.M)  # NullTokenizer without --vocab-size


# examples/megatron_lm_pretrain_gpt.py with the README's flags on 2 CPU ranks, in fp32 (bf16 matrix
# products are slow on CPUs; the README's command runs in bf16 above). DP=2 needs the global batch
# to divide into micro-batches over both ranks: --micro-batch-size 4 --global-batch-size 8 (which
# also runs on one process, as 2 accumulated micro-batches).
CPU_COMMAND = [
    "--optimizer",
    "dion3",
    "--use-distributed-optimizer",
    "--lr",
    "0.01",
    "--decoupled-lr",
    "0.002",
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "256",
    "--max-position-embeddings",
    "256",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--train-iters",
    "100",
    "--eval-interval",
    "50",
    "--eval-iters",
    "2",
    *LOCAL_LAYERS,
]
VALIDATION = re.compile(r"validation loss at iteration\s+(\d+) \| lm loss value: (\S+)")


def test_cpu_command_on_two_ranks_learns_and_validation_loss_falls():
    """The command, shortened (6 iterations of 128-token sequences, validation at 3 and 6; a
    512-token language, whose successor pairs a few steps can learn): training and validation,
    samples of one language, fall."""
    argv = list(CPU_COMMAND)
    shorter = (("--seq-length", "128"), ("--max-position-embeddings", "128"))
    for flag, value in (("--train-iters", "6"), ("--eval-interval", "3"), ("--eval-iters", "1"), *shorter):
        argv[argv.index(flag) + 1] = value
    log = on_cpu([SCRIPT, *argv, "--vocab-size", "512", "--log-interval", "1"])
    losses = iterations(log)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert float(losses[6][0]) < float(losses[1][0]) - 0.3, losses  # (a running mean from iteration 2 on)
    validation = {int(i): float(loss) for i, loss in VALIDATION.findall(log)}
    assert sorted(validation) == [3, 6] and validation[6] < validation[3] - 0.1, validation
    assert "CPU RNG state changed" not in log  # the CPU shim's forked generator is the CPU one: no false alarm


# DP=2 -> TP=2 at "auto" (f = 1 here) and PP=2 -> DP=2 at 0.5 (rows selected): between them both
# resharding paths and both kinds of state; the shim's checkpoint scenarios check DP=2 -> TP=2 of
# f < 1 state bit for bit (tests/integration/test_megatron_parallel.py), without a ~35 s pretrain() pair.
@pytest.mark.parametrize("saved,loaded,fraction", [("dp2", "tp2", "auto"), ("pp2", "dp2", "0.5")])
def test_a_checkpoint_resumes_in_another_layout(tmp_path, saved, loaded, fraction):
    """Saved at DP=2 and loaded at TP=2, or saved at PP=2 and loaded at DP=2 (Megatron's fully
    reshardable optimizer format, which its Adam part needs to change layout; a vocabulary that
    pads to the same size at both TP sizes): the resumed run repeats the first run's loss and
    gradient norms, so the weights and Dion3's state resharded; with an explicit f and with the
    default, "auto"."""
    same_padding = ["--vocab-size", "256", "--dist-ckpt-optim-fully-reshardable", "--dion3-fraction", fraction]
    full = str(tmp_path / saved)
    first = iterations(pretrain(same_padding + LAYOUTS[saved] + ["--save", full]))
    resumed = iterations(pretrain(same_padding + LAYOUTS[loaded] + ["--load", full, "--ckpt-step", "2"]))
    assert sorted(resumed) == [3, 4]
    assert float(resumed[3][0]) == pytest.approx(float(first[3][0]), rel=1e-5)  # iteration 3: same weights
    for i in (3, 4):  # iteration 4's gradients follow Dion3's step 3, which used the loaded state
        assert float(resumed[i][1]) == pytest.approx(float(first[i][1]), rel=1e-3), (i, resumed, first)


def torch_fsdp2(args: list[str]) -> list[str]:
    """TINY under Megatron's torch FSDP2 (--use-torch-fsdp2, no distributed optimizer) with the
    checkpoint format Megatron requires there for an optimizer outside its own: torch_dcp."""
    args = [a for a in args if a != "--use-distributed-optimizer"]
    args[args.index("--ckpt-format") + 1] = "torch_dcp"
    return args + ["--use-torch-fsdp2"]


def test_pretrain_torch_fsdp2_resumes_exactly_and_at_another_data_parallel_size(tmp_path):
    """--optimizer dion3 --use-torch-fsdp2 through pretrain() at DP=2 (every parameter a DTensor
    whose rows FSDP2 splits over both ranks; tests/integration/test_megatron_parallel.py compares the step with
    the single process): saved at iteration 2 (torch_dcp: Dion3's state as DTensors placed like
    the parameters), resumed at DP=2 it ends with the uninterrupted run's checkpoint tensor for
    tensor; resumed on one rank (DP=1) it repeats the losses and gradient norms."""
    fsdp2 = ["--dion3-fraction", "0.5"]
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    log = on_cpu([SCRIPT, *torch_fsdp2(TINY), *fsdp2, "--save", full])
    assert re.search(r"^ +use_torch_fsdp2 \.+ True$", log, re.M) and re.search(r"^ +dion3_fraction \.+ 0\.5$", log, re.M)
    assert "Layerwise param layout" not in log and "LayerWiseDistributedOptimizer" not in log
    losses = iterations(log)
    assert sorted(losses) == [1, 2, 3, 4] and float(losses[4][0]) < float(losses[1][0])

    again = iterations(on_cpu([SCRIPT, *torch_fsdp2(TINY), *fsdp2, "--load", full, "--ckpt-step", "2", "--save", resumed]))
    assert sorted(again) == [3, 4] and again[3] == losses[3] and again[4][1] == losses[4][1]
    checkpoint_4, resumed_4 = (flat(checkpoint(os.path.join(run, "iter_0000004"))) for run in (full, resumed))
    assert any(k.endswith(".momentum") for k in checkpoint_4) and any(k.endswith(".exp_avg_sq") for k in checkpoint_4)
    # (args name the run's own --save and --load)
    assert_same_checkpoint(*({k: v for k, v in c.items() if not k.startswith("args")} for c in (checkpoint_4, resumed_4)))

    one_rank = iterations(on_cpu([SCRIPT, *torch_fsdp2(TINY), *fsdp2, "--load", full, "--ckpt-step", "2"], nproc=1))
    assert sorted(one_rank) == [3, 4]
    assert float(one_rank[3][0]) == pytest.approx(float(losses[3][0]), rel=1e-5)
    for i in (3, 4):
        assert float(one_rank[i][1]) == pytest.approx(float(losses[i][1]), rel=1e-3), (i, one_rank, losses)


@pytest.mark.parametrize(
    "flags,line",
    [
        (["--use-torch-fsdp2", "--tensor-model-parallel-size", "2"], "--optimizer dion3 --use-torch-fsdp2 steps tensor-parallel size 1"),
        (["--use-megatron-fsdp"], "--optimizer dion3 does not run under Megatron-FSDP (--use-megatron-fsdp); use --use-torch-fsdp2"),
    ],
    ids=["torch-fsdp2-tp2", "megatron-fsdp"],
)
def test_an_fsdp_layout_dion3_does_not_step_is_refused_once_before_megatron_starts(flags, line):
    assert_stopped_once_before_megatron_starts([CPU, SCRIPT, *torch_fsdp2(TINY)[:-1], *flags], line)


@pytest.mark.parametrize("launcher", ["launch", "cpu"])
def test_a_bad_dion3_value_stops_both_ranks_before_megatron_starts_said_once(launcher):
    """--lr -1 with --optimizer dion3, under torchrun with 2 ranks: one line naming the flag and the
    value, before Megatron parses its arguments (no argument dump), let alone builds a model."""
    entry = ["-m", "dion3_megatron.megatron.launch"] if launcher == "launch" else [CPU]
    line = "argument --lr: lr must be a finite number >= 0, got -1.0"
    assert_stopped_once_before_megatron_starts([*entry, SCRIPT, *TINY, "--lr", "-1"], line)


def test_pretrain_with_megatrons_cpu_offload_flags_trains_as_the_run_without_them(saved_run):
    """--use-precision-aware-optimizer --optimizer-cpu-offload (Megatron-LM asks for both) at DP=2:
    Megatron's checks pass for dion3, which takes the offload (on CPU there is no GPU to stream its
    state to: it lives in host memory already, as the log says), Megatron's Adam part is built as
    without it, and the run repeats the losses and gradient norms of the run without the flags."""
    plain = iterations(saved_run("dp2", "0.5")[0])  # (saving changes no step)
    log = pretrain([*dion3_layout("dp2", "0.5"), "--use-precision-aware-optimizer", "--optimizer-cpu-offload"])
    assert re.search(r"^ +optimizer_cpu_offload \.+ True$", log, re.M)
    assert re.search(r"^ +use_precision_aware_optimizer \.+ True$", log, re.M)  # as given (at fp32 it changes nothing for dion3)
    assert "Dion3 offload: no GPU to stream the state to; it lives in host memory already" in log
    assert "HybridDeviceOptimizer" not in log
    assert sorted(plain) == [1, 2, 3, 4] and iterations(log) == plain


@pytest.mark.parametrize(
    "flags,line",
    [
        (
            ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"],
            "--optimizer dion3 offloads all of its state or none: --optimizer-offload-fraction must be 1.0 (or 0: none), got 0.5",
        ),
        (
            ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--dion3-momentum-dtype", "fp32"],
            "--optimizer dion3: --dion3-momentum-dtype fp32 and --exp-avg-dtype bf16 disagree",
        ),
    ],
    ids=["partial-offload", "momentum-dtypes-disagree"],
)
def test_what_dion3_cannot_take_of_megatrons_offload_is_refused_once_before_megatron_starts(flags, line):
    assert_stopped_once_before_megatron_starts([CPU, SCRIPT, *TINY, *flags], line)


BF16_MOMENTUM = ["--dion3-fraction", "0.5", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"]
CONVERTED = "Dion3: the checkpoint's momentum was converted ({}) to the momentum_dtype of this optimizer's param groups"


def dion3_momenta(path: str) -> tuple[dict, dict]:
    """A torch_dist checkpoint's Dion3 momenta (by key) and its saved Dion3 param group (the one
    that names a momentum_dtype: Adam's do not)."""
    saved = flat(checkpoint(path))
    (prefix,) = [k[: -len("momentum_dtype")] for k in saved if k.endswith(".param_groups.0.momentum_dtype")]
    group = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix) and "." not in k[len(prefix) :]}
    return {k: v for k, v in saved.items() if ".optimizer.state.momentum." in k}, group


def test_pretrain_with_bf16_momentum_saves_it_in_bf16_resumes_exactly_and_converts_the_other_dtype(tmp_path):
    """--use-precision-aware-optimizer --exp-avg-dtype bf16 at DP=2: Dion3's momentum in bf16 (the
    args and the log say so; Megatron's Adam part keeps fp32 moments), saved in bf16 with the count
    of steps its rounding hashes in the param group; resumed at iteration 2 it ends with the
    uninterrupted run's checkpoint, tensor for tensor. Resumed without the flags (fp32 momentum)
    the checkpoint's momentum converts, each rank saying so once, and that run's fp32 checkpoint
    (of iteration 3) loads converted back under bf16 and trains on."""
    import torch

    full, resumed, fp32 = (str(tmp_path / name) for name in ("full", "resumed", "fp32"))
    log = pretrain([*BF16_MOMENTUM, "--save", full])
    assert re.search(r"^ +dion3_momentum_dtype \.+ bf16$", log, re.M)
    assert re.search(r"^ +use_precision_aware_optimizer \.+ True$", log, re.M)
    assert "Dion3's momentum is stored in bf16; Megatron's Adam part (embeddings, output layer, norms, biases) keeps fp32 moments" in log
    losses = iterations(log)
    assert sorted(losses) == [1, 2, 3, 4] and float(losses[4][0]) < float(losses[1][0])
    for iteration in (2, 4):
        momenta, group = dion3_momenta(os.path.join(full, f"iter_000000{iteration}"))
        assert momenta and {v.dtype for v in momenta.values()} == {torch.bfloat16}
        assert group["momentum_dtype"] == "bf16" and group["rounding_step"] == iteration

    again = iterations(pretrain([*BF16_MOMENTUM, "--load", full, "--ckpt-step", "2", "--save", resumed]))
    assert sorted(again) == [3, 4] and again[3] == losses[3] and again[4][1] == losses[4][1]
    checkpoint_4 = checkpoint(os.path.join(full, "iter_0000004"))
    assert_same_checkpoint(checkpoint_4, checkpoint(os.path.join(resumed, "iter_0000004")))
    assert dion3_momenta(os.path.join(resumed, "iter_0000004"))[1]["rounding_step"] == 4  # (common state, which the above skips)

    log = pretrain(["--dion3-fraction", "0.5", "--load", full, "--ckpt-step", "2", "--save", fp32, "--save-interval", "1"])
    assert log.count(CONVERTED.format("torch.bfloat16 to torch.float32")) == 2  # once on each rank
    assert iterations(log)[3] == losses[3]
    momenta, group = dion3_momenta(os.path.join(fp32, "iter_0000003"))
    assert {v.dtype for v in momenta.values()} == {torch.float32}
    assert group["momentum_dtype"] == "fp32" and "rounding_step" not in group
    log = pretrain([*BF16_MOMENTUM, "--load", fp32, "--ckpt-step", "3"])
    assert log.count(CONVERTED.format("torch.float32 to torch.bfloat16")) == 2
    assert sorted(iterations(log)) == [4]
