"""Hugging Face Trainer + DeepSpeed (``TrainingArguments(deepspeed=config_dict)``) on 2 CPU ranks (gloo).

The config route as Trainer drives it: Trainer hands DeepSpeed one flat parameter list and a
config whose values are "auto"; the registration splits the list by module. Tiny random-init
Llama (untied head) and GPT-2 (tied head, Conv1D) models, no downloads. One multi-process session
runs everything; the tests read its results.
"""

from __future__ import annotations

import importlib.util

import pytest

from support.dist_utils import run_distributed

pytestmark = pytest.mark.slow

if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs deepspeed and transformers", allow_module_level=True)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from support import hf_trainer_helpers as hh

    return run_distributed(hh.session, 2, str(tmp_path_factory.mktemp("hf")), timeout=600)


def _by_algorithm(split: dict) -> dict:
    return {a: sorted(n for n, b in split.items() if b == a) for a in ("dion3", "adamw", "none")}


def _falls(losses: list, by: float) -> bool:
    return sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - by


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_llama_hidden_matrices_take_dion3_embedding_untied_head_and_norms_adamw(session, stage):
    print(
        session[0]["seconds"],
        {k: [round(x, 3) for x in v["losses"]] for k, v in session[0].items() if isinstance(v, dict) and "split" in v},
    )
    run = session[0][f"llama_zero{stage}"]
    assert run["zero"] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
    split = _by_algorithm(run["split"])
    assert split["none"] == []
    assert split["dion3"] == sorted(
        f"model.layers.{i}.{m}_proj.weight"
        for i in range(2)
        for m in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "mlp.gate", "mlp.up", "mlp.down")
    )
    assert "lm_head.weight" in split["adamw"] and "model.embed_tokens.weight" in split["adamw"]
    assert all(n.endswith("norm.weight") for n in split["adamw"] if n not in ("lm_head.weight", "model.embed_tokens.weight"))
    assert _falls(run["losses"], 0.5), run["losses"]


def test_a_config_without_fraction_gets_auto_chosen_under_zero1(session):
    run = session[0]["llama_default"]
    assert set(run["fractions"]) == {"auto"}, run["fractions"]
    chosen = [f for c in run["chosen"] for f in c.values()]  # per saved param group: {matrix name: f}
    assert chosen and set(chosen) == {1.0}, run["chosen"]  # every matrix here has fewer than 128 rows: all kept
    assert _falls(run["losses"], 0.5), run["losses"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages_train_alike(session, stage):
    # At fraction 1 (hf_trainer_helpers.session: no top-k selection to flip on a near tie), measured 5e-7.
    a, b = session[0]["llama_zero1"]["losses"], session[0][f"llama_zero{stage}"]["losses"]
    assert len(a) == len(b) == 10 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)


def test_zero2_with_offload_optimizer_to_the_cpu_trains_as_without_it(session):
    run = session[0]["llama_zero2_offload"]
    a, b = session[0]["llama_zero2"]["losses"], run["losses"]
    assert run["offload"] is True
    assert len(a) == len(b) == 10 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)


def test_gpt2_conv1d_weights_take_adamw_and_the_tied_head_too(session):
    run = session[0]["gpt2_zero1"]
    split = _by_algorithm(run["split"])
    # Conv1D stores (in, out): Dion3 would select and normalize input features. AdamW, said in the log.
    assert split["dion3"] == [] and split["none"] == []
    assert {"lm_head.weight", "transformer.wte.weight", "transformer.h.0.attn.c_attn.weight"} <= set(split["adamw"])
    assert _falls(run["losses"], 0.5), run["losses"]


def test_gpt2_with_conv1d_as_linear_gives_the_hidden_matrices_to_dion3(session):
    run = session[0]["gpt2_linear_zero2"]
    split = _by_algorithm(run["split"])
    assert split["dion3"] == sorted(
        f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert split["adamw"].count("lm_head.weight") == 1 and "transformer.wte.weight" in split["adamw"]  # tied: one tensor
    assert _falls(run["losses"], 0.5), run["losses"]


def test_trainer_resume_from_a_checkpoint_continues_identically(session):
    for out in session:
        resume = out["resume"]
        assert resume["diff"] == 0.0
        assert resume["losses"][0] == resume["losses"][1]


def test_plain_dion3_under_zero_fails_naming_the_class_to_use(session):
    message = session[0]["plain_dion3_error"]
    assert message is not None and "DeepSpeedDion3" in message and "ZeRO stage 1" in message, message
