"""torchtitan's own trainer (torchtitan.train's main) with ``--module dion3_megatron.torchtitan
--config llama3_debugmodel_dion3``, on two CPU processes over gloo (examples/torchtitan_cpu.py;
torchtitan's FSDP2 over the two ranks): four steps with a checkpoint by its CheckpointManager after
the second, then a second run that loads that checkpoint and runs the last two."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from support.repository import ROOT

pytest.importorskip("torchtitan")  # its trainer's packages are in the tests' install (README): without them, these fail

from benchmarks.bench_torchtitan import ANSI, steps_of  # noqa: E402

from dion3_megatron.torchtitan import HIDDEN_MATRICES  # noqa: E402

STEPS, SAVED = 4, 2
TRAINER = [
    "--module", "dion3_megatron.torchtitan", "--config", "llama3_debugmodel_dion3",
    "--training.steps", str(STEPS), "--training.seq_len", "64", "--training.local_batch_size", "4",
    "--checkpoint.enable", "--checkpoint.interval", str(SAVED),
]  # fmt: skip


def train(folder: pathlib.Path, *more: str) -> str:
    """The log of torchtitan's trainer on 2 CPU ranks, its checkpoints in ``folder``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(ROOT / "examples" / "torchtitan_cpu.py"), *TRAINER, "--dump_folder", str(folder), *more]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    log = ANSI.sub("", done.stdout + done.stderr)
    assert done.returncode == 0 and "Traceback (most recent call last)" not in log, log[-6000:]
    return log


def losses(log: str) -> dict[int, float]:
    return {step: loss for step, (loss, _) in steps_of(log).items()}


def saved_optimizer(checkpoint: pathlib.Path, part: str) -> dict[str, set[str]]:
    """Parameter name -> the names it has in ``part`` ("state" or "param_groups") of the optimizer
    in a DCP checkpoint of torchtitan's (its keys: optimizer.PART.NAME.KEY)."""
    import torch.distributed.checkpoint as dcp

    found: dict[str, set[str]] = {}
    for key in dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata:
        if key.startswith(f"optimizer.{part}.") and ".fractions." not in key:  # Dion3's record of f: a key per matrix
            name, _, kind = key.removeprefix(f"optimizer.{part}.").rpartition(".")
            found.setdefault(name, set()).add(kind)
    return found


@pytest.mark.slow
def test_torchtitans_trainer_runs_dion3_and_resumes_from_its_checkpoint_as_the_uninterrupted_run(tmp_path):
    whole = losses(train(tmp_path))
    assert sorted(whole) == list(range(1, STEPS + 1)), whole
    assert whole[STEPS] < whole[1] - 0.2, whole  # it trains: about 8.1 to 7.4

    state = saved_optimizer(tmp_path / "checkpoint" / f"step-{SAVED}", "state")
    groups = saved_optimizer(tmp_path / "checkpoint" / f"step-{SAVED}", "param_groups")
    matrices = {name for name in state if re.search(HIDDEN_MATRICES, name)}
    assert len(matrices) == 6 * 5, sorted(state)  # the debug model's six layers, five matrices each
    adamw = {"exp_avg", "exp_avg_sq"}
    assert all("momentum" in state[name] and not state[name] & adamw for name in matrices), state  # Dion3's
    assert all(adamw <= state[name] for name in state.keys() - matrices), state  # AdamW's
    assert groups.keys() == state.keys() and all({"algorithm", "fraction"} <= g for g in groups.values()), groups  # all in Dion3

    log = train(tmp_path, "--checkpoint.load_step", str(SAVED))
    assert f"Loading the checkpoint from {tmp_path}/checkpoint/step-{SAVED}" in log, log[-6000:]
    resumed = losses(log)
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1)), resumed
    # The step after the resumed one moves the weights by the loaded Dion3 state: without it
    # (--checkpoint.exclude_from_loading optimizer) step 4's loss differs by about 0.1.
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole[step], abs=1e-4), (step, resumed, whole)


@pytest.mark.slow  # torchtitan's model modules take seconds to import
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the reference: eager on purpose
def test_the_cpu_runners_attention_is_flex_attentions_with_the_same_mask():
    """examples/torchtitan_cpu.py's SDPA stand-in gives FlexAttention's output (its forward runs on
    CPU) for torchtitan's document-causal block mask, grouped-query heads included."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    from torchtitan.models.common.attention import get_document_mask_mod

    from examples.torchtitan_cpu import dense_flex_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 8, generator=gen)
    k, v = (torch.randn(2, 2, 32, 8, generator=gen) for _ in range(2))
    positions = torch.tensor([list(range(10)) + list(range(22)), list(range(32))])  # two documents in the first row
    mask = create_block_mask(get_document_mask_mod(positions), 2, None, 32, 32, device="cpu")
    expected = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    kwargs = dict(score_mod=None, block_mask=mask, scale=None, enable_gqa=True, return_aux=AuxRequest(), kernel_options={})
    out, _ = dense_flex_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    causal_only = create_block_mask(get_document_mask_mod(torch.arange(32).repeat(2, 1)), 2, None, 32, 32, device="cpu")
    assert not torch.allclose(dense_flex_attention(q, k, v, **{**kwargs, "block_mask": causal_only})[0], expected)


def test_the_cpu_runners_tokenizer_has_a_token_per_byte_and_bos_and_eos(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from examples.torchtitan_cpu import byte_tokenizer

    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(byte_tokenizer(tmp_path)))
    text = "déjà vu\n"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 256 and ids[-1] == 257 and len(ids) == len(text.encode()) + 2
    assert max(ids[1:-1]) < 256 and tokenizer.decode(ids[1:-1]) == text and tokenizer.get_vocab_size() == 258
