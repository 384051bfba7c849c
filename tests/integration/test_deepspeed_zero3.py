"""DeepSpeed ZeRO stage 3 on CPU (gloo): equal to stage 0 at 2 and 4 ranks, with deepspeed.zero.Init,
gradient accumulation, a skipped step, checkpoints and universal checkpoints at another world size.

Two process groups (2 ranks, then 4, which loads what the 2-rank one saved) run every check; the
tests below assert on their results.
"""

from __future__ import annotations

import importlib.util

import pytest

from support.dist_utils import run_distributed

pytestmark = pytest.mark.slow  # every test reads the results of one multi-process run

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs deepspeed", allow_module_level=True)

TOL = 1e-6  # fp32, stage 3 vs stage 0 (measured: 1.2e-7)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero3")


@pytest.fixture(scope="module")
def two_ranks(workdir):
    from support import deepspeed_zero3

    return run_distributed(deepspeed_zero3.session_two_ranks, 2, str(workdir))


@pytest.fixture(scope="module")
def four_ranks(workdir, two_ranks):  # loads the universal checkpoint the 2-rank session wrote
    from support import deepspeed_zero3

    return run_distributed(deepspeed_zero3.session_four_ranks, 4, str(workdir))


def test_zero3_equals_zero0_with_and_without_zero_init(two_ranks):
    for rank, out in enumerate(two_ranks):
        assert out["moved"] > 1e-2, "training must change the parameters for the comparison to mean anything"
        for run in ("s3", "s3_zero_init"):
            assert out["initial_diff"][run] == 0.0, (rank, run, out["initial_diff"])  # the same model to start
            assert out["diff"][run] <= TOL, (rank, run, out["diff"])
            # split by module under zero.Init too (its parameters' shapes are empty until gathered)
            assert out["algorithms"][run] == ["dion3", "adamw"], (rank, run, out["algorithms"])
    for run in ("s3", "s3_zero_init"):
        # A matrix cut over both ranks is stepped as a "flat" piece on each; one whole in a rank's
        # partition (2 of the 3 experts: the cut falls inside the middle one) by that rank alone.
        kinds = {
            name: [[kind for kind, _ in out["pieces"][run].get(name, [])] for out in two_ranks]
            for out_ in two_ranks
            for name in out_["pieces"][run]
        }
        assert len(kinds) == 7, kinds  # 3 experts, fc1, fc2, odd, tiny
        split = [name for name, k in kinds.items() if k == [["flat"], ["flat"]]]
        whole = [name for name, k in kinds.items() if sorted(k) == [[], ["full"]]]
        assert len(split) == 5 and len(whole) == 2, kinds


def test_a_plain_parameter_list_built_under_zero_init_is_split_by_logical_shape(two_ranks):
    # DeepSpeedDion3(model.parameters()) under zero.Init: matrices (2-D, 3-D) take Dion3, vectors AdamW
    assert two_ranks[0]["plain_list_zero_init"] == [("dion3", [2] * 6 + [3]), ("adamw", [1, 1, 1])], two_ranks[0]


def test_zero3_clips_raw_gradients(two_ranks):
    # Clipping at 0.5 acted on every step (norm measured before clipping) and stage 3 still equals stage 0.
    assert min(two_ranks[0]["norms"]) > 0.5, two_ranks[0]["norms"]


def test_zero3_state_is_partition_shaped_and_equals_stage0_state(two_ranks):
    out = two_ranks[0]
    assert all(keys == ["exp_avg", "exp_avg_sq", "row_age", "step"] for keys in out["state_keys"]), out["state_keys"]
    assert out["state_shapes_match"]
    for key in ("momentum", "variance", "adamw"):  # read through DeepSpeed's safe_get_full_optimizer_state
        assert out["state"][key] <= TOL, out["state"]
    assert out["params_between_steps"] == [0, 0]  # ZeRO-3 empties the groups between steps


def test_zero3_gradient_accumulation_orthogonalizes_once_per_optimizer_step(two_ranks):
    for out in two_ranks:
        assert out["ga_diff"] <= TOL, out["ga_diff"]
        steps, partitions = out["ga_engine_steps"]  # partitions with Dion3 matrices
        assert partitions == 1 and steps == 3, out["ga_engine_steps"]  # 3 optimizer steps of 3 micro-batches each


def test_zero3_non_finite_gradient_on_one_rank_skips_the_step_everywhere(two_ranks):
    for out in two_ranks:
        nan = out["nan"]
        assert nan["change"] == 0.0 and nan["skipped"] == 1, nan
        assert nan["finite"] and nan["then_moved"] > 0, nan


def test_zero3_non_finite_gradient_in_one_sub_group_on_one_rank_skips_one_step_on_every_rank(two_ranks):
    # The NaN reaches Dion3 alone (DeepSpeed saw finite gradients), in the second of several
    # sub-groups, on rank 0: one decision for the step, before the first sub-group changed anything.
    for rank, out in enumerate(two_ranks):
        r = out["nan_in_one_partition"]
        assert r["partitions"] > 2 and r["deepspeed_skipped"] == 0, (rank, r)
        assert r["skipped"] == 1, (rank, r)  # one step, not one per sub-group
        assert r["change"] == 0.0 and r["state_change"] == 0.0, (rank, r)
        assert r["then_moved"] > 0, (rank, r)


def test_zero3_collectives_per_step_do_not_grow_with_the_sub_groups(two_ranks):
    for rank, out in enumerate(two_ranks):
        runs = out["collectives"]
        assert sorted(r["dion3_sub_groups"] for r in runs.values()) == [1, 2, 5], (rank, runs)
        for r in runs.values():
            assert r["diff"] <= TOL, (rank, runs)
        counts = {size: r["counts"] for size, r in runs.items()}
        assert len({tuple(c) for c in counts.values()}) == 1, (rank, counts)  # the same at 1, 2 and 5 sub-groups
        assert all(c > 0 for c in next(iter(counts.values()))), (rank, counts)


def test_zero3_checkpoint_resume_is_bit_identical(two_ranks):
    for out in two_ranks:
        assert out["resume_diff"] == 0.0, out["resume_diff"]


def test_zero3_auto_fraction_choices_over_sub_groups_survive_a_resume(two_ranks):
    # Each rank records every matrix of every sub-group of the Dion3 param group (its own and those
    # other ranks hold); the resumed run's device would choose f = 1, so equal steps mean the saved
    # choices were used.
    names = set()
    for rank, out in enumerate(two_ranks):
        auto = out["auto"]
        assert auto["dion3_partitions"] > 1, auto  # the Dion3 group's matrices lie in several sub-groups
        names |= set(auto["record"][0])  # the Dion3 group's record
        assert 0.125 in auto["record"][0].values() and len(auto["record"][0]) == 7, (rank, auto["record"])
        assert auto["diff"] == 0.0, (rank, auto["diff"])
    assert len(names) == 7, names


def test_zero3_universal_checkpoint_keeps_settings_and_row_ages(two_ranks):
    for out in two_ranks:
        assert out["universal_diff"] <= TOL, out["universal_diff"]
        # the stock converter drops the rows' ages, and they mattered
        assert out["universal_without_ages_diff"] > 100 * TOL, out["universal_without_ages_diff"]


def test_zero3_four_ranks_uneven_pieces_and_sub_groups_equal_zero0(four_ranks):
    for rank, out in enumerate(four_ranks):
        assert out["diff"] <= TOL, (rank, out["diff"])
        # sub_group_size 100 splits the Dion3 group (and the AdamW one) into several sub-groups
        assert out["sub_groups"].count(0) > 1 and out["plans"] == len(out["sub_groups"]), out
    # the 1 x 3 matrix has 3 elements for 4 ranks: ranks 0-2 hold one each, rank 3 only padding (it
    # joins the matrix's collectives with an empty piece); the 5 x 7 one is cut 9, 9, 9, 8
    by_shape = [{name.split(" ", 1)[1]: pieces for name, pieces in out["pieces"].items()} for out in four_ranks]
    assert [r["(1, 3)"] for r in by_shape] == [[("flat", 1)]] * 3 + [[("flat", 0)]], by_shape
    assert [r["(5, 7)"] for r in by_shape] == [[("flat", 9)]] * 3 + [[("flat", 8)]], by_shape


def test_zero3_universal_checkpoint_loads_at_another_world_size(four_ranks):
    for rank, out in enumerate(four_ranks):
        assert out["universal_diff"] <= TOL, (rank, out)  # saved by 2 ranks, loaded by 4 (under zero.Init)


def test_zero3_tensor_parallel_matrices_are_stepped_whole(four_ranks):
    # TP=2 (a Megatron-style mpu) x DP=2 at stage 3: every column- and row-parallel block cut over the
    # data-parallel ranks, against the unsharded model stepped by the single-process optimizer.
    for rank, out in enumerate(four_ranks):
        r = out["tensor_parallel"]
        assert r["piece_kinds"] == ["block_flat", "flat"], (rank, r)  # the TP blocks, and the replicated matrix
        assert r["moved"] > 1e-3 and r["diff"] <= TOL and r["cut_inside_a_block"] > 0, (rank, r)
        r = out["tensor_parallel_bf16"]  # bf16 weights, fp32 partitions: within bf16 rounding of the fp32 reference
        assert r["moved"] > 1e-3 and r["diff"] < 0.015, (rank, r)
