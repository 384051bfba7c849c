"""Dion3 in torchtitan's MoE models: the default regex names their hidden matrices (3-D routed
experts, routers, shared experts, dense layers, MLA projections), and torchtitan's deepseek_v3,
parallelized by its own parallelize_deepseekv3 on gloo with FSDP2, expert parallelism and tensor
parallelism, the optimizer built by its OptimizersContainer, checkpoints through its
CheckpointManager, steps as the single-process Dion3 (and AdamW) on the whole model; the experts
sharded by experts or split inside their matrices (FSDP2's Shard(1) when more ranks hold them
than there are experts)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("torchtitan.models.common.moe")

from support import torchtitan_helpers as helpers  # noqa: E402
from support import torchtitan_moe as moe  # noqa: E402
from support.dist_utils import run_distributed  # noqa: E402
from support.equality import assert_equal  # noqa: E402
from support.torchtitan_helpers import SETTINGS  # noqa: E402

from dion3_megatron import torchtitan as dion3_torchtitan  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

EXPERTS = tuple(f"moe.routed_experts.inner_experts.{w}" for w in ("w1_EFD", "w2_EDF", "w3_EFD"))
MOE = ("moe.router.gate.weight", *(f"moe.shared_experts.w{i}.weight" for i in (1, 2, 3)), *EXPERTS)
MLA = tuple(f"attention.{w}.weight" for w in ("wq", "wkv_a", "wkv_b", "wo"))
DENSE_FFN = tuple(f"feed_forward.w{i}.weight" for i in (1, 2, 3))
# The tiny model's Dion3 matrices: layer 0 dense, layer 1 MoE.
MATRICES = {f"layers.0.{m}" for m in MLA + DENSE_FFN} | {f"layers.1.{m}" for m in MLA + MOE}


def _chosen(model: torch.nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters() if re.search(dion3_torchtitan.HIDDEN_MATRICES, n)}


def test_the_default_regex_names_the_matrices_of_torchtitans_moe_models_wherever_wrappers_put_them():
    """qwen3's MoE debug model and deepseek_v3's (with a multi-token-prediction layer), as torchtitan
    builds them: exactly their hidden matrices, the 3-D experts and the routers among them; the
    embeddings, the head, the norms and the load-balancing buffers not."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torchtitan.models.deepseek_v3 import deepseekv3_configs
    from torchtitan.models.qwen3 import qwen3_configs

    with torch.device("meta"):
        qwen3 = qwen3_configs["debugmodel_moe"](attn_backend="flex").build()
        deepseek = deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard", num_mtp_layers=1).build()
    qwen3_matrices = {
        f"layers.{i}.{m}"
        for i in range(8)
        for m in ("attention.qkv_linear.wqkv.weight", "attention.wo.weight", "moe.router.gate.weight", *EXPERTS)
    }
    assert _chosen(qwen3) == qwen3_matrices
    deepseek_matrices = (
        {f"layers.0.{m}" for m in MLA + DENSE_FFN}
        | {f"layers.{i}.{m}" for i in range(1, 6) for m in MLA + MOE}
        | {f"mtp_layers.0.{m}" for m in (*MLA, *MOE, "eh_proj.weight")}
    )
    assert _chosen(deepseek) == deepseek_matrices
    for model in (qwen3, deepseek):
        rest = {n: p for n, p in model.named_parameters() if n not in _chosen(model)}
        assert all(p.dim() == 1 or n in ("tok_embeddings.weight", "lm_head.weight") for n, p in rest.items()), sorted(rest)
        assert {n for n, p in model.named_parameters() if p.dim() == 3} == {n for n in _chosen(model) if n.endswith(("_EFD", "_EDF"))}
        buffers = {n.rsplit(".", 1)[1] for n, _ in model.named_buffers() if ".moe." in n}
        assert buffers == {"expert_bias_E", "tokens_per_expert_E"}  # buffers: not the optimizer's
        # torchtitan's activation checkpointing wraps each block (FullAC: torch's checkpoint_wrapper)
        chosen = _chosen(model)
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, checkpoint_wrapper(block))
        wrapped = _chosen(model)
        assert len(wrapped) == len(chosen) and all("_checkpoint_wrapped_module" in n for n in wrapped if n.startswith("layers."))
        assert {n.replace("_checkpoint_wrapped_module.", "") for n in wrapped} == chosen
    for name in ("layers.3.attention.wq_a.weight", "layers.3.attention.wq_b.weight"):  # MLA with a query LoRA (236B, 671B)
        assert re.search(dion3_torchtitan.HIDDEN_MATRICES, name), name
    for name in (
        "layers.1.attention.kv_norm.weight",
        "layers.1.attention.q_norm.weight",
        "layers.1.moe.router.gate.bias",  # (gpt_oss's router has one)
        "layers.1.moe.routed_experts.inner_experts.mlp1_weight_EGD",  # gpt_oss: gate and up interleaved
        "layers.1.moe.routed_experts.inner_experts.w1_EDF",  # experts stored the other way round
        "mtp_layers.0.enorm.weight",
    ):
        assert not re.search(dion3_torchtitan.HIDDEN_MATRICES, name), name


def test_torchtitans_experts_multiply_by_their_rows_as_output_features():
    """torchtitan's GroupedExperts (bf16 grouped GEMMs) computes each expert as nn.Linear layers of
    its (out, in) matrices would: expert e's output rows are w1[e]'s and w3[e]'s rows, so Dion3's
    rows of an expert are its output features, as a dense layer's are; and the fp32 experts the
    CPU tests run compute the same, in fp32."""
    from torchtitan.models.common.moe import GroupedExperts

    config = {"dim": 64, "hidden_dim": 32, "num_experts": 4}
    stock, fp32 = GroupedExperts.Config(**config).build(), moe.GroupedExpertsInParamDtype.Config(**config).build()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (stock, fp32):
            for w in (module.w1_EFD, module.w2_EDF, module.w3_EFD):
                w.copy_(0.2 * torch.randn(w.shape, generator=gen))
        fp32.load_state_dict(stock.state_dict())
        counts = torch.tensor([3, 0, 5, 8])
        x = torch.randn(int(counts.sum()), 64, generator=gen)
        expected = torch.cat(
            [
                torch.nn.functional.linear(
                    torch.nn.functional.silu(torch.nn.functional.linear(part, stock.w1_EFD[e]))
                    * torch.nn.functional.linear(part, stock.w3_EFD[e]),
                    stock.w2_EDF[e],
                )
                for e, part in enumerate(x.split(counts.tolist()))
            ]
        )
        torch.testing.assert_close(stock(x, counts), expected, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(fp32(x, counts), expected, rtol=1e-5, atol=1e-6)


@pytest.fixture
def registered():
    dion3_torchtitan.register()
    yield
    dion3_torchtitan.unregister()


def test_the_default_config_gives_moe_matrices_to_dion3_each_expert_a_matrix(registered):
    model = moe.built_model()
    optimizers, _, _ = helpers.one_dion3(model, SETTINGS, MATRICES)
    flat = optimizers.state_dict()  # torchtitan first steps a fresh optimizer with zero gradients at lr 0
    key = "state.layers.1.moe.routed_experts.inner_experts.{}.{}"
    assert flat[key.format("w1_EFD", "momentum")].shape == (moe.EXPERTS, moe.EXPERT_HIDDEN, moe.DIM)
    assert flat[key.format("w1_EFD", "variance")].shape == (moe.EXPERTS, moe.EXPERT_HIDDEN)  # a row: an output feature
    assert flat[key.format("w2_EDF", "variance")].shape == (moe.EXPERTS, moe.DIM)
    assert flat["state.layers.1.moe.router.gate.weight.variance"].shape == (1, moe.EXPERTS)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(moe.session, 2, moe.LAYOUTS, "ep", SETTINGS, str(tmp_path_factory.mktemp("moe-2")), timeout=600)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_distributed(moe.session, 4, moe.LAYOUTS_4, "ep x efsdp, rows", SETTINGS, str(tmp_path_factory.mktemp("moe-4")), timeout=600)


def _references(outs: list[dict]) -> dict[tuple[int, int], dict]:
    return {out["reference"]["model"]: out["reference"] for out in outs if "reference" in out}


def _assert_steps_as_the_reference(outs: list[dict], layouts: dict[str, moe.Layout]) -> None:
    references = _references(outs)
    for layout, reference in references.items():  # the steps moved every matrix: the comparison means something
        start = dict(moe.built_model(*layout).named_parameters())
        assert all((reference["params"][n] - start[n]).abs().max() > 1e-3 for n in MATRICES), layout
    for out in outs:
        for name, case in out["cases"].items():
            layout = layouts[name]
            expected = references[layout.experts, layout.top_k]
            assert case["types"] == ["Dion3"]
            assert_equal(case["params"], expected["params"], name)
            assert case["state"].keys() == expected["state"].keys() == MATRICES
            for matrix, parts in case["state"].items():  # the state as the ranks place it, gathered
                assert_equal(parts, expected["state"][matrix], f"{name} state of {matrix}")


def _expert_placements(outs: list[dict], name: str) -> dict[str, tuple]:
    held = outs[0]["cases"][name]["placements"]
    return {w: held[f"layers.1.{w}"] for w in EXPERTS}


@pytest.mark.slow
def test_fsdp2_expert_and_tensor_parallelism_of_parallelize_deepseekv3_step_as_the_single_process_run(two_ranks):
    w1, w2, w3 = EXPERTS
    assert _expert_placements(two_ranks, "fsdp") == dict.fromkeys(EXPERTS, (Shard(0),))
    assert _expert_placements(two_ranks, "ep") == dict.fromkeys(EXPERTS, (_StridedShard(0, split_factor=2), Shard(0)))
    # tensor parallelism splits each expert, w1 and w3 by rows, w2 by columns (FSDP2 over one rank)
    assert _expert_placements(two_ranks, "tp") == {w1: (Shard(0), Shard(1)), w2: (Shard(0), Shard(2)), w3: (Shard(0), Shard(1))}
    assert two_ranks[0]["cases"]["tp"]["placements"]["layers.1.moe.router.gate.weight"] == (Shard(0), Replicate())
    _assert_steps_as_the_reference(two_ranks, moe.LAYOUTS)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_as_the_uninterrupted_run_at_two_ranks_and_at_one(two_ranks):
    expected = _references(two_ranks)[moe.EXPERTS, moe.TOP_K]["params"]
    for out in two_ranks:
        assert_equal(out["resumed"], expected, "resumed at 2 ranks")
    assert_equal(two_ranks[0]["resumed at one rank"], expected, "resumed at 1 rank (FSDP2 alone)")


@pytest.mark.slow
def test_experts_fsdp2_shards_by_rows_under_expert_parallelism_step_and_resume_as_the_single_process_run(four_ranks):
    """4 ranks, expert parallelism 2: torchtitan's FSDP2 shards the experts over the 2 ranks of each
    expert group by experts where there are enough (4), by rows where not (2 experts: Shard(1))."""
    assert _expert_placements(four_ranks, "ep x efsdp") == dict.fromkeys(EXPERTS, (_StridedShard(0, split_factor=2), Shard(0)))
    assert _expert_placements(four_ranks, "ep x efsdp, rows") == dict.fromkeys(EXPERTS, (Shard(1), Shard(0)))
    _assert_steps_as_the_reference(four_ranks, moe.LAYOUTS_4)
    expected = _references(four_ranks)[2, 1]["params"]
    for out in four_ranks:
        assert_equal(out["resumed"], expected, "resumed at 4 ranks")
    assert_equal(four_ranks[0]["resumed at one rank"], expected, "resumed at 1 rank (FSDP2 alone)")
