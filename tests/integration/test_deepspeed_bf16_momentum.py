"""DeepSpeed with ``"momentum_dtype": "bf16"`` on CPU (gloo, 2 ranks): ZeRO-1/2/3 keep the Dion3
groups' ``exp_avg`` slices in bf16 and step as ZeRO-0 does with a bf16 momentum; regular and
universal checkpoints resume it; a param group that mixes matrices and AdamW tensors is refused
at ZeRO 1-3. One process group runs every check; the tests assert on its results."""

from __future__ import annotations

import importlib.util

import pytest

from support.dist_utils import run_distributed

pytestmark = pytest.mark.slow  # every test reads the results of one multi-process run

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs deepspeed", allow_module_level=True)

TOL = 1e-6  # stage 1-3 vs stage 0, as with an fp32 momentum (tests/integration/test_deepspeed_zero.py)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from support import deepspeed_bf16

    return run_distributed(deepspeed_bf16.session, 2, str(tmp_path_factory.mktemp("deepspeed-bf16")))


def test_zero_stages_with_a_bf16_momentum_equal_zero0(two_ranks):
    for rank, out in enumerate(two_ranks):
        assert out["moved"] > 1e-2 and out["bf16 vs fp32"] > 1e-5, out  # the steps move; the bf16 momentum is not fp32's
        assert max(out["diff"].values()) <= TOL, (rank, out["diff"])
        assert out["stage0 momentum dtypes"] == ["torch.bfloat16"]
        for stage, apart in out["momentum vs stage 0"].items():  # read back through DeepSpeed's accessor
            assert max(apart.values()) == 0.0, (rank, stage, apart)


def test_the_dion3_groups_exp_avg_is_bf16_and_adamws_fp32(two_ranks):
    for out in two_ranks:
        for name in ("s1", "s2", "s3"):
            assert out["state"][name]["dtypes"] == {
                "dion3": ["exp_avg torch.bfloat16", "exp_avg_sq torch.float32", "row_age torch.float32"],
                "adamw": ["exp_avg torch.float32", "exp_avg_sq torch.float32", "row_age torch.float32"],
            }, (name, out["state"][name]["dtypes"])


def test_a_bf16_momentum_saves_two_bytes_per_element_of_the_dion3_partitions(two_ranks):
    """The momentum in bf16 (2 bytes), the row variance and age repeated over each row's elements
    in fp32, as DeepSpeed's checkpoints need them slice-shaped (4 + 4): 10 bytes per element, 12
    with an fp32 momentum."""
    for out in two_ranks:
        assert {name: state["bytes per element"] for name, state in out["state"].items()} == {
            "s1": 10.0,
            "s2": 10.0,
            "s3": 10.0,
            "s1 fp32": 12.0,
        }


def test_a_checkpoint_resumes_bit_identically_at_zero2_and_zero3(two_ranks):
    """The rounding's count of steps is the partitions' ``step``, which the checkpoint keeps."""
    for out in two_ranks:
        for stage in (2, 3):
            assert out[f"zero{stage} resume"] == {"params equal": True, "state equal": True}, (stage, out[f"zero{stage} resume"])


def test_a_universal_checkpoint_resumes_in_the_optimizers_momentum_dtype(two_ranks):
    """ZeRO-2's checkpoint, converted, resumed at ZeRO-1, and ZeRO-3's at ZeRO-3, as the
    uninterrupted runs; under an fp32 config each loads converted, the groups keeping their own
    momentum_dtype (DeepSpeed's universal loads set every saved key of a param group)."""
    for out in two_ranks:
        assert set(out["universal"]) == {"zero2 to zero1", "zero3 to zero3"}
        for case, resumed in out["universal"].items():
            assert resumed["diff"] <= TOL, (case, resumed)
            assert resumed["momentum_dtype"] == ["bf16"] and "exp_avg torch.bfloat16" in resumed["dtypes"]["dion3"], (case, resumed)
        assert set(out["universal into fp32"]) == set(out["universal"])
        for case, into_fp32 in out["universal into fp32"].items():
            assert into_fp32["momentum_dtype"] == ["fp32"] and "exp_avg torch.float32" in into_fp32["dtypes"]["dion3"], (case, into_fp32)


def test_a_bf16_momentum_in_a_group_with_adamw_tensors_is_refused_at_zero_1_to_3(two_ranks):
    for out in two_ranks:
        assert out["mixed group"][0] is None  # ZeRO-0: whole parameters, AdamW's state apart
        message = out["mixed group"][1]
        assert message is not None and message.startswith("param group 0: momentum_dtype='bf16' stores the exp_avg"), message
        assert "take AdamW" in message and "\n" not in message, message


def test_switching_a_group_to_bf16_converts_its_exp_avg_and_deepspeed_reads_the_new_one(two_ranks):
    for out in two_ranks:
        switched = out["switched to bf16"]
        assert "exp_avg torch.bfloat16" in switched["dtypes"]["dion3"], switched
        assert switched["bf16 values"] and switched["moved"], switched
