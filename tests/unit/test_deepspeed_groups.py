"""Which tensors take Dion3 in the DeepSpeed config route (split by module), and GPT-2's Conv1D (no processes)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from support.deepspeed_helpers import import_keeping_environment

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs deepspeed", allow_module_level=True)

dion3_ds = import_keeping_environment("dion3_megatron.deepspeed")
groups_module = import_keeping_environment("dion3_megatron.deepspeed.groups")


class Tied(torch.nn.Module):
    """Embedding and output head tied (GPT-2 style); the head module has a name no pattern knows."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8, bias=False)
        self.frozen.requires_grad_(False)
        self.ln = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 10, bias=False)
        self.out.weight = self.tok.weight


class Untied(torch.nn.Module):
    """An untied head found through get_output_embeddings (Hugging Face's accessor), not by name."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.decoder = torch.nn.Linear(8, 10, bias=False)

    def get_output_embeddings(self):
        return self.decoder


def _ids(params):
    return [id(p) for p in params]


def test_flat_list_is_split_by_module_keeping_the_given_order_and_only_the_given_tensors():
    m = Tied()
    given = [p for p in m.parameters() if p.requires_grad]
    groups = dion3_ds.engine_param_groups(m, given)
    assert [g["algorithm"] for g in groups] == ["dion3", "adamw"]
    assert _ids(groups[0]["params"]) == [id(m.fc.weight)]
    assert _ids(groups[1]["params"]) == [id(m.tok.weight), id(m.fc.bias), id(m.ln.weight), id(m.ln.bias)]
    # A subset (what DeepSpeed was given) stays a subset; a generator works like a list.
    groups = dion3_ds.engine_param_groups(m, iter([m.fc.weight, m.frozen.weight]))
    assert [(g["algorithm"], _ids(g["params"])) for g in groups] == [("dion3", [id(m.fc.weight), id(m.frozen.weight)])]
    # None: DeepSpeed's own default, every parameter of the model.
    assert sum(len(g["params"]) for g in dion3_ds.engine_param_groups(m, None)) == len(list(m.parameters()))


def test_untied_head_found_by_get_output_embeddings():
    m = Untied()
    groups = dion3_ds.engine_param_groups(m, m.parameters())
    assert _ids(groups[0]["params"]) == [id(m.proj.weight)]
    assert id(m.decoder.weight) in _ids(groups[1]["params"])


def test_groups_with_an_algorithm_are_kept_and_the_others_split_keeping_their_keys():
    m = Tied()
    explicit = {"params": [m.tok.weight], "algorithm": "dion3", "lr": 0.1}  # the user's choice, kept
    moe_like = {"params": [m.fc.weight, m.fc.bias, m.ln.weight], "name": "dense-params", "moe": False, "weight_decay": 0.0}
    groups = dion3_ds.engine_param_groups(m, [explicit, moe_like])
    assert groups[0] is explicit
    assert groups[1] == {"name": "dense-params", "moe": False, "weight_decay": 0.0, "params": [m.fc.weight], "algorithm": "dion3"}
    assert groups[2] == {
        "name": "dense-params",
        "moe": False,
        "weight_decay": 0.0,
        "params": [m.fc.bias, m.ln.weight],
        "algorithm": "adamw",
    }


def test_a_matrix_outside_the_model_is_split_by_its_dims_and_logged(caplog):
    m = Untied()
    stray = torch.nn.Parameter(torch.zeros(4, 4))
    with caplog.at_level("WARNING", logger="dion3_megatron.deepspeed"):
        groups = dion3_ds.engine_param_groups(m, [m.proj.weight, stray])
    assert _ids(groups[0]["params"]) == [id(m.proj.weight), id(stray)]
    assert "1 matrices not in the engine's model take Dion3 by their dims" in caplog.text


def test_the_config_route_is_installed_on_the_engine():
    from deepspeed.runtime.engine import DeepSpeedEngine

    from dion3_megatron import compat

    assert compat.is_patched(DeepSpeedEngine._configure_basic_optimizer)
    assert compat.is_patched(DeepSpeedEngine._do_optimizer_sanity_check)


# Importing transformers takes over a second.
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


@pytest.mark.slow
@needs_transformers
def test_conv1d_weights_take_adamw_with_a_log_line(caplog):
    from transformers.pytorch_utils import Conv1D

    m = torch.nn.Sequential(Conv1D(6, 4), torch.nn.Linear(6, 6))
    with caplog.at_level("WARNING", logger="dion3_megatron.deepspeed"):
        groups = dion3_ds.engine_param_groups(m, m.parameters())
    assert _ids(groups[0]["params"]) == [id(m[1].weight)]
    assert id(m[0].weight) in _ids(groups[1]["params"])
    assert "1 Conv1D (in, out)" in caplog.text and "conv1d_as_linear" in caplog.text


@pytest.mark.slow
@needs_transformers
def test_conv1d_as_linear_computes_the_same_and_keeps_conv1ds_state_dict_layout():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    m = torch.nn.Sequential(Conv1D(6, 4), torch.nn.GELU(), Conv1D(5, 6))  # Conv1D(nf=out, nx=in)
    x = torch.randn(3, 7, 4)
    expected, saved = m(x), {k: v.clone() for k, v in m.state_dict().items()}
    assert dion3_ds.conv1d_as_linear(m) == 2
    assert tuple(m[0].weight.shape) == (6, 4)  # (out, in), like nn.Linear
    torch.testing.assert_close(m(x), expected)
    state = m.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in saved.items()}
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    m.load_state_dict(saved)  # a GPT-2 (in, out) state dict loads into the converted model
    torch.testing.assert_close(m(x), expected)
    assert [g["algorithm"] for g in dion3_ds.param_groups(m)] == ["dion3", "adamw"]
    assert _ids(dion3_ds.param_groups(m)[0]["params"]) == [id(m[0].weight), id(m[2].weight)]
    with pytest.raises(ValueError, match=r"0.weight: expected Conv1D's layout \(4, 6\), got \(6, 4\)"):
        m.load_state_dict({**saved, "0.weight": saved["0.weight"].t()})


@pytest.mark.slow
@needs_transformers
def test_a_converted_gpt2_saves_as_gpt2_and_loads_back(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8)).eval()
    tokens = torch.randint(0, 32, (2, 8))
    expected = model(tokens).logits
    dion3_ds.conv1d_as_linear(model)
    torch.testing.assert_close(model(tokens).logits, expected)
    model.save_pretrained(tmp_path)
    plain = GPT2LMHeadModel.from_pretrained(tmp_path).eval()  # GPT-2's own class, Conv1D layout
    torch.testing.assert_close(plain(tokens).logits, expected)
    converted = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    dion3_ds.conv1d_as_linear(converted)
    torch.testing.assert_close(converted(tokens).logits, expected)
