"""The communication model: Dion3's rounds are constant in depth, its bytes scale with f."""

import pytest

from benchmarks import comm_model


@pytest.mark.parametrize("layout,shallow_layers", [(comm_model.Layout(2, 1, 1), 2), (comm_model.Layout(8, 2, 4), 12)])
def test_rounds_do_not_grow_with_depth(layout, shallow_layers):
    # Once each rank owns a matrix of every shape (ZeRO-1 spreads them), rounds stop growing.
    shallow = comm_model.ModelConfig("shallow", shallow_layers, 1024, 4096)
    deep = comm_model.ModelConfig("deep", 48, 1024, 4096)
    assert comm_model.dion3_step(shallow, layout, 0.25)["rounds"] == comm_model.dion3_step(deep, layout, 0.25)["rounds"]
    assert comm_model.dion3_step(deep, layout, 0.25)["rounds"] <= 1 + 2 * 3  # 3 distinct shapes
    growth = 48 / shallow_layers  # Muon's rounds grow with depth
    assert comm_model.muon_step(deep, layout)["rounds"] >= 0.75 * growth * comm_model.muon_step(shallow, layout)["rounds"]


def test_row_traffic_scales_with_fraction():
    cfg = comm_model.ModelConfig("8B", 32, 4096, 14336)
    layout = comm_model.Layout(8, 1, 1)
    score_bytes = comm_model.dion3_step(cfg, layout, 1e-9)["bytes"]  # k = 1: almost only the scores
    rows = {f: comm_model.dion3_step(cfg, layout, f)["bytes"] - score_bytes for f in (1.0, 0.25, 0.125)}
    assert rows[0.25] / rows[1.0] == pytest.approx(0.25, rel=0.01)
    assert rows[0.125] / rows[1.0] == pytest.approx(0.125, rel=0.01)


def test_scaling_table_covers_8_to_4096_gpus_and_1b_to_100b():
    rows = comm_model.table()
    assert {r["gpus"] for r in rows} == {8, 64, 512, 4096}
    assert {"1B", "100B"} <= {r["model"] for r in rows}
    for r in rows:
        assert r["dion3_0.25"]["rounds"] <= 7
        assert r["dion3_0.25"]["total_s"] < r["muon"]["total_s"]
