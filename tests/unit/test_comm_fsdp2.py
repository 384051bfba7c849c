"""The FSDP2 communication model (benchmarks/comm_fsdp2.py) against what the engine sends: on gloo
at 4 ranks, Dion3 steps DTensor matrices sharded by rows (Shard(0)), every collective of the
step is recorded (kind, elements per destination, dtype), and the record must equal the model's
prediction for that case, rank by rank (at 2 ranks the `--measure` command of docs/scaling.md, which
exits 1 where they differ)."""

from __future__ import annotations

import math

import pytest

from benchmarks import comm_fsdp2
from support.dist_utils import run_distributed

GROUPS, CHOSEN, FRACTION = comm_fsdp2.SMALL_GROUPS, comm_fsdp2.SMALL_CHOSEN, comm_fsdp2.SMALL_FRACTION


def _record_step(rank: int, world: int) -> dict:
    return comm_fsdp2.recorded_step(rank, world, "dion3_megatron")


@pytest.mark.slow  # multi-process; at 2 ranks docs/scaling.md's `--measure` command (run by the docs' test) checks it
def test_model_equals_what_the_engine_sends():
    world = 4
    measured = run_distributed(_record_step, world, timeout=120)
    for rank, got in enumerate(measured):
        predicted = comm_fsdp2.dion3_megatron_step(GROUPS, world, FRACTION, rank, selected=CHOSEN)
        assert all(float(e).is_integer() for c in predicted for e in c.elements)
        expected = comm_fsdp2.predicted_small("dion3_megatron", world, rank)
        assert got["record"][:2] == expected[:2], f"rank {rank}: the gate and the scores' all-reduce"
        assert sorted(got["record"][2:]) == sorted(expected[2:]), f"rank {rank}"
        # The engine's own count: everything but the gate, one all-reduce and 2 all-to-alls per shape.
        assert got["collectives"] == ["all_reduce"] + ["all_to_all_single"] * 2 * len(GROUPS)
        sent = sum(c.bytes_sent(rank, world) for c in predicted)
        assert sent == pytest.approx(
            sum((2 * (world - 1) / world * e[0] if kind == "all_reduce" else sum(e) - e[rank]) * size for kind, e, size in got["record"])
        )


def test_uniform_spread_matches_an_even_choice():
    # Without the chosen rows the model spreads k over the shards; with rows chosen evenly it is exact.
    groups = [(16, 8, 3)]
    even = comm_fsdp2.dion3_megatron_step(groups, 4, 0.5, 1)
    chosen = comm_fsdp2.dion3_megatron_step(groups, 4, 0.5, 1, selected={(16, 8): CHOSEN[16, 8]})
    assert [c.elements for c in even] == [c.elements for c in chosen]


def test_rounds_per_shape_group():
    for cfg in comm_fsdp2.DENSE:
        groups = comm_fsdp2.shape_groups(cfg)
        assert len(groups) == 3  # q, k, v, proj (h x h); gate, up (ffn x h); down (h x ffn)
        row = comm_fsdp2.compare(cfg, 8, 0.25)
        assert row["dion3_megatron"]["rounds"] == 2 + 2 * len(groups)
        assert row["microsoft_nordion2_local"]["rounds"] == row["microsoft_whole_shards"]["rounds"] == 2 * len(groups)


def test_table_orders_the_paths():
    rows = comm_fsdp2.table()
    assert {r["world"] for r in rows} == {8, 16, 32, 64} and {"1B", "100B"} <= {r["model"] for r in rows}
    for r in rows:
        ours, local, whole = (r[k]["bytes"] for k in ("dion3_megatron", "microsoft_nordion2_local", "microsoft_whole_shards"))
        # fp32 rows with their variances and the scores against bf16 rows: about twice their local scope's
        # bytes; whole bf16 shards are 1 / (2 f) = 2x ours' rows at f = 1/4.
        assert 1.6 < ours / local < 2.2
        assert whole > 1.5 * ours


def test_microsoft_pads_batches_and_shards():
    # 3 matrices of 10 x 4 over 4 ranks: the batch pads to 4 (1 each), the shards to ceil(10 / 4) = 3 rows,
    # k_loc = ceil(0.5 * 3) = 2 rows each: 1 * 2 * 4 elements to every rank, bf16.
    (out, back) = comm_fsdp2.microsoft_step([(10, 4, 3)], 4, 0.5)
    assert out.elements == back.elements == (8, 8, 8, 8) and out.itemsize == 2
    assert out.bytes_sent(0, 4) == 3 * 8 * 2
    assert math.isclose(comm_fsdp2.microsoft_step([(10, 4, 3)], 4, None)[0].elements[0], 1 * 3 * 4)
