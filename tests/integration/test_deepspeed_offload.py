"""DeepSpeed's ZeRO-Offload for Dion3 on CPU (gloo, 2 ranks): ``"offload_optimizer": {"device":
"cpu"}`` at ZeRO 1, 2 and 3 trains as the same run without it; with the CPU standing in for the GPU
the offloaded step streams to, DeepSpeed's host partitions, their gradients and Dion3's state
travel through every copy, and the run is the same again. One process group runs every check
(tests/support/deepspeed_offload.py); the tests below assert on its results."""

from __future__ import annotations

import importlib.util

import pytest

from support.dist_utils import run_distributed

pytestmark = pytest.mark.slow  # every test reads the results of one multi-process run

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs deepspeed", allow_module_level=True)


@pytest.fixture(scope="module")
def two_ranks():
    from support import deepspeed_offload

    return run_distributed(deepspeed_offload.session_two_ranks, 2, timeout=900)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_to_the_cpu_trains_as_the_run_without_it(two_ranks, stage):
    for rank, out in enumerate(two_ranks):
        r = out["stages"][stage]
        assert r["class"] == "DeepSpeedZeroDion3" and r["moved"] > 1e-2, (rank, r)
        assert r["flags"] == (False, True, True), (rank, r)  # offload_optimizer turned Dion3's offload on
        # No GPU: nothing to stream to (the state is in host memory with the partitions); with the
        # CPU standing in for one, the engine streams to it.
        assert r["engines"] == ("None", "None", "cpu"), (rank, r)
        for run in ("offload", "streamed"):
            assert r[run]["params"] == 0.0 and r[run]["state"] == 0.0, (rank, run, r)


def test_dion3s_own_offload_at_zero_stage_0_trains_as_without_it(two_ranks):
    for out in two_ranks:
        assert out["stage0"] == {"diff": 0.0, "offload": True}, out["stage0"]


def test_a_dion3_object_handed_to_initialize_takes_offload_with_zero_force_ds_cpu_optimizer_false(two_ranks):
    for out in two_ranks:
        assert out["client"] == {"diff": 0.0, "offload": True}, out["client"]


@pytest.mark.parametrize(
    "case, words",
    [
        ("nvme", ["Dion3 offloads its state to host memory, not to 'nvme'", '"offload_optimizer": {"device": "cpu"}']),
        ("ratio", ['offload_optimizer "ratio" must be 1.0, got 0.5']),
        ("own_offload_under_zero", ['Dion3 "offload": true under ZeRO stage 2', '"offload_optimizer": {"device": "cpu"}']),
    ],
)
def test_what_dion3_cannot_take_of_optimizer_offload_fails_at_initialize_in_one_line(two_ranks, case, words):
    message = two_ranks[0]["errors"][case]
    assert message is not None and "\n" not in message, (case, message)
    for w in words:
        assert w in message, (w, message)
