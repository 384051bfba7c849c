"""Dion3 under torchtitan 0.3's pipeline parallelism: the llama3 model split into stages by its own
pipeline_llm on gloo (1F1B with one stage per rank, Interleaved1F1B and ZBVZeroBubble with two,
1F1B by FSDP2), one Dion3 per stage built by its OptimizersContainer; every run, and
every resume of a checkpoint of its CheckpointManager (with and without the pipeline), equal to the
single-process Dion3 (and AdamW) on the whole model."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("torchtitan.distributed.pipeline_parallel")

from support import torchtitan_helpers as helpers  # noqa: E402
from support import torchtitan_pipeline as pipeline  # noqa: E402
from support.dist_utils import run_distributed  # noqa: E402
from support.equality import assert_equal  # noqa: E402
from support.torchtitan_helpers import SETTINGS  # noqa: E402

from dion3_megatron.torchtitan import HIDDEN_MATRICES  # noqa: E402

# The modules of each rank's stages, in the schedule's order, as torchtitan splits them: one stage
# per rank (the embeddings and the head count as a layer), or one layer per stage, the stages
# looped over the ranks (Interleaved1F1B) or folded in a V (ZBVZeroBubble: rank 0 holds the first
# and the last stage).
STAGES = {
    "1F1B": [[["layers.0", "tok_embeddings"]], [["layers.1", "lm_head", "norm"]]],
    "Interleaved1F1B": [[["layers.0", "tok_embeddings"], ["layers.2"]], [["layers.1"], ["layers.3", "lm_head", "norm"]]],
    "ZBVZeroBubble": [[["layers.0", "tok_embeddings"], ["layers.3", "lm_head", "norm"]], [["layers.1"], ["layers.2"]]],
}


def test_torchtitans_loss_summed_over_microbatches_has_the_gradients_of_the_reference_loss():
    """The schedule's loss (torchtitan's MSELoss against zero targets over the global count of
    logits, one per microbatch, summed: scale_grads=False) and the reference's (loss_of of the
    whole batch) give the same gradients."""
    from torchtitan.components.loss import MSELoss

    loss_fn = MSELoss.Config().build()
    tokens, positions = helpers.batches()[0], helpers.positions()
    whole, split = helpers.built_model(), helpers.built_model()
    helpers.loss_of(whole(tokens, positions)).backward()
    count = torch.tensor(pipeline.COUNT)
    for i in range(0, helpers.BATCH, pipeline.MICROBATCH):
        logits = split(tokens[i : i + pipeline.MICROBATCH], positions[i : i + pipeline.MICROBATCH])
        loss, _ = loss_fn(logits, torch.zeros_like(logits), count)
        loss.backward()
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_a_stage_without_hidden_matrices_is_refused_by_torchtitans_container():
    """torchtitan's OptimizersContainer refuses a param-group pattern that matches nothing in a model
    part: every stage must hold some hidden matrices and some other parameters."""
    from torchtitan.distributed.pipeline_parallel import _split_module

    embeddings = _split_module(helpers.built_model(), ["tok_embeddings"])
    with pytest.raises(ValueError, match="matched no parameters"):
        helpers.container([embeddings], SETTINGS)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("torchtitan-pp-checkpoint"))
    return run_distributed(pipeline.session, 2, SETTINGS, folder, list(pipeline.SCHEDULES), timeout=600)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("torchtitan-pp-fsdp-checkpoint"))
    return run_distributed(pipeline.session, 4, SETTINGS, folder, ["1F1B"], timeout=600)


@pytest.fixture(scope="module")
def references():
    """The single-process runs, by the model's number of layers."""
    return {layers: helpers.reference(SETTINGS, layers) for layers in {layers for layers, _ in pipeline.SCHEDULES.values()}}


def _part_held(expected: dict, held: dict) -> dict:
    """The tensors of ``expected`` that a rank's stages hold (``held``): a part of the model, of its
    names (the ranks' parts together are the whole model: checked where they are joined)."""
    assert held.keys() <= expected.keys(), held.keys() - expected.keys()
    return {name: expected[name] for name in held}


def _assert_stepped_as_the_reference(outs: list[dict], schedule: str, expected: dict) -> None:
    """Every rank's stages equal the reference, and the ranks' stages together are the whole model."""
    held = set()
    for rank, out in enumerate(outs):
        params = out["cases"][schedule]["params"]
        assert_equal(params, _part_held(expected, params), f"{schedule} rank {rank}")
        held |= params.keys()
    assert held == expected.keys(), expected.keys() - held


def _assert_one_dion3_per_stage(case: dict) -> None:
    """Per stage, in order: a Dion3 stepping its hidden matrices by the Dion3 rule, the rest by AdamW."""
    assert len(case["optimizers"]) == len(case["stages"])
    for (kind, rule_names, adamw_names), hidden, stage in zip(case["optimizers"], case["hidden"], case["stages"]):
        assert kind == "Dion3"
        assert rule_names == hidden and len(hidden) == 5 * sum(m.startswith("layers.") for m in stage)
        assert adamw_names and not any(re.search(HIDDEN_MATRICES, n) for n in adamw_names)
    assert case["scale_grads"] is False  # the microbatches' losses add up (torchtitan's schedule)


@pytest.mark.slow
def test_each_schedule_splits_the_model_as_torchtitan_does_with_a_dion3_per_stage(two_ranks):
    for schedule, stages in STAGES.items():
        for rank, out in enumerate(two_ranks):
            case = out["cases"][schedule]
            assert case["stages"] == stages[rank], (schedule, rank)
            _assert_one_dion3_per_stage(case)
            assert case["placements"] == [("(Shard(dim=0),)", 1)]  # parallelize_llama's FSDP2 over a mesh of one


@pytest.mark.slow
def test_each_schedule_steps_as_the_single_process_run(two_ranks, references):
    for schedule, (layers, _) in pipeline.SCHEDULES.items():
        _assert_stepped_as_the_reference(two_ranks, schedule, references[layers])


@pytest.mark.slow
def test_a_pipeline_by_fsdp2_steps_as_the_single_process_run(four_ranks, references):
    stages = STAGES["1F1B"]
    for rank, out in enumerate(four_ranks):  # the pipeline is the mesh's outer dimension
        case = out["cases"]["1F1B"]
        assert case["stages"] == stages[rank // 2], rank
        _assert_one_dion3_per_stage(case)
        assert case["placements"] == [("(Shard(dim=0),)", 2)]
    _assert_stepped_as_the_reference(four_ranks, "1F1B", references[helpers.LAYERS])


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_as_the_uninterrupted_run_with_the_pipeline_and_at_one_rank(two_ranks, four_ranks, references):
    expected = references[helpers.LAYERS]
    for outs, what in ((two_ranks, "PP"), (four_ranks, "PP x FSDP2")):
        held = set()
        for rank, out in enumerate(outs):
            assert_equal(out["resumed"], _part_held(expected, out["resumed"]), f"{what} resumed, rank {rank}")
            held |= out["resumed"].keys()
        assert held == expected.keys()
        resumed_whole = outs[0]["resumed at one rank"]  # the whole model, no pipeline
        assert resumed_whole.keys() == expected.keys()
        assert_equal(resumed_whole, expected, f"{what} resumed at one rank without the pipeline")


@pytest.mark.slow
def test_a_non_finite_gradient_on_one_stage_skips_the_step_of_every_stage(two_ranks, four_ranks):
    """A NaN in the embedding's gradient on rank 0 alone (the first stage; under FSDP2 one of its
    two shards): every rank of both stages keeps every weight (AdamW's tensors too) and counts the
    skipped step."""
    for rank, out in enumerate(two_ranks + four_ranks):
        assert out["poisoned on rank 0"] == {"unchanged": True, "skipped": [1]}, rank
