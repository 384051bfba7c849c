"""benchmarks/step_memory.py: the memory estimates of the optimizer-step benchmarks, against the
extra memory measured for single matrices, the default that makes bench_step.py fit an 80 GB GPU,
and the figures docs/performance.md states."""

from __future__ import annotations

import json
import re
import sys

from support.repository import ROOT

if str(ROOT / "benchmarks") not in sys.path:  # the benchmarks import each other as the scripts they are
    sys.path.insert(0, str(ROOT / "benchmarks"))

import step_memory  # noqa: E402
from bench_step import LAYERS  # noqa: E402

MIB = 2**20
# torch.cuda.get_device_properties(0).total_memory of an H100 80GB HBM3 and of an H200
H100 = int(79.1 * step_memory.GIB)
H200 = int(139.8 * step_memory.GIB)


def test_the_single_matrix_terms_give_the_measured_extra_memory():
    """wide-1xh100.json: max_memory_allocated during a step minus what was allocated before it."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "wide-1xh100.json").read_text())["results"]
    for shape, runs in measured.items():
        n, c = map(int, shape.split("x"))
        for name, run in runs.items():
            if name == "muon":
                estimate = step_memory.muon_step_bytes(n, c)
            else:
                fraction = {"dion3 f=1": 1.0, "dion3 f=1/4": 0.25, "dion3 f=1/8": 0.125}[name]
                estimate = step_memory.dion3_step_bytes([(n, c, 1)], fraction)
            assert abs(estimate / MIB - run["peak_extra_mib"]) <= 1, (shape, name, estimate / MIB, run["peak_extra_mib"])


def test_bench_step_runs_eight_layers_where_they_fit_and_four_on_an_80_gb_gpu():
    eight, four = (step_memory.bench_step_bytes(LAYERS["14b"], layers)["total"] for layers in (8, 4))
    assert H100 < eight < step_memory.FITS * H200 and four < step_memory.FITS * H100
    assert step_memory.default_layers(LAYERS["14b"], H200) == 8
    assert step_memory.default_layers(LAYERS["14b"], H100) == 4
    assert step_memory.default_layers(LAYERS["14b"], 1) == 1  # the fewest, whatever the GPU


def test_the_parts_add_up_and_the_state_is_four_bytes_per_parameter_per_tensor():
    parts = step_memory.bench_step_bytes(LAYERS["14b"], 8)
    parameters = 8 * sum(n * c for n, c in LAYERS["14b"])
    assert parts["state"] == 4 * parameters * 7  # parameters, gradients, Muon's and four Dion3s' momenta
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert parts["dion3 f=auto"] >= max(
        step_memory.dion3_step_bytes(step_memory.shape_groups(LAYERS["14b"], 8), f) for f in step_memory.AUTO_CHOICES
    )


def _gib(value: int) -> str:
    return f"{value / step_memory.GIB:.1f} GiB"


def test_the_performance_page_states_the_estimates():
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    eight, four = (step_memory.bench_step_bytes(LAYERS["14b"], layers) for layers in (8, 4))
    section = text[text.index("## Optimizer step on one GPU, 14B shapes") : text.index("## FSDP2 on one GPU")]
    assert f"{_gib(eight['total'])} at 8 layers, {_gib(eight['state'])} of" in section
    assert f"runs\n4 layers ({_gib(four['total'])})" in section or f"runs 4 layers ({_gib(four['total'])})" in section
    table = text[text.index("## GPU memory of each command") : text.index("## On CPU")]
    rows = {row.split("|")[1].strip().strip("`"): row.split("|")[2].strip() for row in re.findall(r"^\|.*\|$", table, re.M)[2:]}
    assert rows["python benchmarks/bench_step.py"] == (
        f"{_gib(eight['total'])} at 8 layers (estimate): an H200; an 80 GB GPU runs 4 layers, {_gib(four['total'])} (estimate)"
    )
    small = step_memory.bench_step_bytes(LAYERS["350m"], 24)["total"]
    assert rows["python benchmarks/bench_step.py --model 350m --layers 24"] == f"{_gib(small)} (estimate)"
    fsdp2 = next(value for command, value in rows.items() if "bench_fsdp2.py --model 14b --layers 4" in command)
    assert fsdp2.startswith(f"{_gib(step_memory.fsdp2_state_bytes(LAYERS['14b'], 4))} for the parameters")
