"""Claims of the docs that a reader can check against the code, the tests and the results: each
test reads the claim from the doc, so that a doc and what it describes cannot drift apart."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import io
import json
import math
import pathlib
import re
import statistics
from typing import Any, Callable

from support.repository import ROOT

RESULTS = ROOT / "benchmarks" / "results"


def test_the_troubleshooting_kernel_check_tells_the_truth_on_a_machine_without_kernels():
    from dion3_megatron import kernels

    text = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    snippet = re.search(r"```python\n(.*?kernels.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "troubleshooting.md", "exec"), {})
    printed = out.getvalue()
    assert not re.search(r": True$", printed, re.M) or kernels.kernels_installed(), printed
    if not kernels.kernels_installed():
        assert re.search(r"run on: torch$", printed, re.M), printed


def _constant(test_file: str, name: str) -> float:
    tree = ast.parse((ROOT / "tests" / test_file).read_text(encoding="utf-8"))
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == name)


def test_the_deepspeed_doc_states_the_tolerance_its_tests_check():
    doc = (ROOT / "docs" / "deepspeed.md").read_text(encoding="utf-8")
    for test_file in ("integration/test_deepspeed_zero.py", "integration/test_deepspeed_zero3.py"):
        stated = re.search(rf"{re.escape(test_file)}[^*]*?within ([0-9.e-]+) of stage 0", doc, re.S)
        assert stated, test_file
        assert float(stated.group(1)) == _constant(test_file, "TOL"), (test_file, stated.group(1))


def test_the_docs_site_shows_the_results_plots_unchanged():
    assets = sorted((ROOT / "docs" / "assets").glob("*.png"))
    assert assets
    for asset in assets:
        assert asset.read_bytes() == (RESULTS / asset.name).read_bytes(), asset.name


# ------------------------------------------------------------------------------------------------
# Figures: each measured figure of the README and the docs, read from its passage and compared with
# the value of its JSON in benchmarks/results/ at the precision the doc gives it.


def at(data: Any, path: str) -> Any:
    """The value at a path of keys ("runs/14b/ms/Dion3 f=1/4"; "/" inside a key is written "\\/")."""
    for key in re.split(r"(?<!\\)/", path):
        key = key.replace("\\/", "/")
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


@dataclasses.dataclass(frozen=True)
class Figures:
    """The figures of one passage of a doc: ``passage`` is a regex whose groups are the figures, in
    the order of ``values``, each a JSON path or a function of the JSON (a range's ends)."""

    doc: str
    passage: str
    result: str
    values: tuple[str | Callable[[Any], float], ...]


def states(written: str, value: float) -> bool:
    """Whether a figure as written is the value at the precision written (its number of decimals)."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return float(written) == round(float(value), decimals)


def vs_muon(size: str, family: str) -> str:
    return f"sizes/{size}/vs_muon/{family}/vs_muon"


SMALL_AUTO, SMALL_HALF = (
    vs_muon("10.8M", "dion3 auto (f = 1 here), default settings, lr 0.01"),
    vs_muon("10.8M", "dion3 f = 1\\/2, default settings, lr 0.02"),
)
SMALL_QUARTER, SMALL_EIGHTH = (
    vs_muon("10.8M", "dion3 f = 1\\/4, default settings, lr 0.04"),
    vs_muon("10.8M", "dion3 f = 1\\/8, default settings, lr 0.04"),
)
SMALL_ADAMW = vs_muon("10.8M", "adamw, lr 0.0015")
MEDIUM_AUTO, MEDIUM_QUARTER = (
    vs_muon("48.7M", "dion3 auto (f = 1 here), default settings, lr 0.01"),
    vs_muon("48.7M", "dion3 f = 1\\/4, default settings, best lr 0.02"),
)
MEDIUM_EIGHTH, MEDIUM_ADAMW = vs_muon("48.7M", "dion3 f = 1\\/8, default settings, lr 0.04"), vs_muon("48.7M", "adamw, lr 0.00075")


def quarter_range(data: Any) -> list[float]:
    return sorted(at(data, p) for p in (SMALL_QUARTER, MEDIUM_QUARTER))


def auto_range(data: Any) -> list[float]:
    return sorted(-at(data, p) for p in (SMALL_AUTO, MEDIUM_AUTO))


def per_shape(kind: str, end: Callable[[Any], float]) -> Callable[[Any], float]:
    return lambda data: end(r[kind] for r in data["ratios"].values())


STEP = ("ratio_vs_muon/dion3 f=1\\/4", "ratio_vs_muon/dion3 f=1\\/8", "ratio_vs_muon/dion3 f=1", "ratio_vs_muon/dion3 auto")
FSDP2 = ("runs/14b/muon_over_this/Dion3 f=1\\/4", "runs/14b/ours_f_quarter_vs_microsoft_dion3")
MEGATRON = (
    "measurements/0/muon_over_dion3/call 1",
    "measurements/0/muon_over_dion3/call 2",
    "measurements/0/dion3_minus_adam_ms/call 1",
    "measurements/0/dion3_minus_adam_ms/call 2",
    "measurements/1/minus_adam_ms/dion3 auto",
)
ORTHO_QUACK = (per_shape("eager: ours vs quack", min), per_shape("eager: ours vs quack", max))
ORTHO_FASTER = (
    per_shape("eager: ours vs the faster of gram-torch and quack", min),
    per_shape("eager: ours vs the faster of gram-torch and quack", max),
)
TRAINER = ("above_adamw_ms/dion3 f=1\\/4", "iteration_ms/adamw", "above_adamw_ms/muon")


def CPU_MINUTES(measurement: int) -> Callable[[Any], float]:  # noqa: N802 (a value path, like the constants beside it)
    return lambda data: at(data, f"measurements/{measurement}/wall_clock_s") / 60


def COMPARED(key: str, optimizer: str) -> Callable[[Any], float]:  # noqa: N802
    """A value of one optimizer's run in examples/pretrain_gpt.py's --compare output."""
    return lambda data: next(run[key] for run in data["results"] if run["optimizer"] == optimizer)


BF16_MOMENTUM = "convergence-bf16-momentum-1xh100.json"
OFFLOAD = "offload-14b-1xh100.json"
CPU_OFFLOAD_POLICY = "fsdp2-cpu-offload-policy-1xh100.json"


def bf16_runs(data: Any, fraction: float, momentum: str, key: str = "final_val_loss") -> list[float]:
    """``key`` of the runs at ``fraction`` with the momentum stored in ``momentum``, by seed."""
    runs = [r for r in data["runs"] if r["f"] == fraction and r["options"].get("mom", "fp32") == momentum]
    return [r[key] for r in sorted(runs, key=lambda r: r["seed"])]


CONVERGENCE_ROW = (
    r"\"auto\" \(f = 1 here\) \*\*([-+]\d\.\d+)\*\*;{} f = 1/4 \*\*([-+]\d\.\d+)\*\*; f = 1/8 ([-+]\d\.\d+); AdamW ([-+]\d\.\d+) \|"
)
FIGURES = [
    # README: the opening paragraph and the table.
    Figures(
        "README.md",
        r"the optimizer step takes\s+(\d+\.\d+)x less time than Muon's at f = 1/4 and (\d+\.\d+)x less at f = 1; the default picks f = 1/2 "
        r"for the\s+square and wide ones there, (\d+\.\d+)x",
        "step-14b-h200.json",
        (STEP[0], STEP[2], STEP[3]),
    ),
    Figures(
        "README.md",
        r"f = 1/4\s+ended (\d\.\d+)-(\d\.\d+) nats per byte above Muon's loss, and the default, which picked f = 1 at those\s+sizes, "
        r"(\d\.\d+)-(\d\.\d+) below it",
        "convergence-summary.json",
        (lambda d: quarter_range(d)[0], lambda d: quarter_range(d)[1], lambda d: auto_range(d)[0], lambda d: auto_range(d)[1]),
    ),
    Figures(
        "README.md",
        r"\| f = 1/4 \*\*(\d+\.\d+)x\*\* less time; f = 1/8 (\d+\.\d+)x; f = 1 (\d+\.\d+)x; \"auto\" (\d+\.\d+)x \| Muon \|",
        "step-14b-h200.json",
        STEP,
    ),
    Figures(
        "README.md",
        r"\| f = 1/4 \*\*(\d+\.\d+)x\*\* less time than microsoft/dion's Muon; (\d+\.\d+)x less than microsoft/dion's Dion3 at f = 1/4 \|",
        "fsdp2-step-h200.json",
        FSDP2,
    ),
    Figures(
        "README.md",
        r"\*\*(\d+\.\d+)x\*\* less time than Muon's NS5 over 8 shapes; (\d+\.\d+)x less than the same Gram Newton-Schulz "
        r"on quack's kernels \(per shape (\d\.\d\d)-(\d\.\d\d)x against quack, (\d\.\d\d)-(\d\.\d\d)x against the faster of "
        r"cuBLAS and quack\)",
        "gram-ns-h200.json",
        ("total_ratios/eager: ours vs muon", "total_ratios/eager: ours vs quack", *ORTHO_QUACK, *ORTHO_FASTER),
    ),
    Figures(
        "README.md",
        r"f = 1/4 \*\*(\d+\.\d+)x\*\* and \*\*(\d+\.\d+)x\*\* less \(two runs\), \+(\d+\.\d+) and \+(\d+\.\d+) ms above Adam; "
        r"\"auto\" \(f = 1 at this width\) \+(\d+\.\d+) ms above Adam",
        "megatron-lm-350m-1xh200.json",
        MEGATRON,
    ),
    Figures(
        "README.md",
        r"10\.8M byte GPT.*?" + CONVERGENCE_ROW.format(""),
        "convergence-summary.json",
        (SMALL_AUTO, SMALL_QUARTER, SMALL_EIGHTH, SMALL_ADAMW),
    ),
    Figures(
        "README.md",
        r"48\.7M byte GPT.*?" + CONVERGENCE_ROW.format(""),
        "convergence-summary.json",
        (MEDIUM_AUTO, MEDIUM_QUARTER, MEDIUM_EIGHTH, MEDIUM_ADAMW),
    ),
    Figures(
        "README.md",
        r"f = 1/4 added\s+(\d+\.\d+) ms to AdamW's (\d+\.\d+) ms iteration and DeepSpeed's Muon (\d+\.\d+) ms",
        "hf-trainer-25m-1xh100.json",
        TRAINER,
    ),
    # docs/performance.md: the headline table and the sections' sentences.
    Figures(
        "docs/performance.md",
        r"\| f = 1/4 \*\*(\d+\.\d+)x\*\* less time; f = 1/8 (\d+\.\d+)x; f = 1 (\d+\.\d+)x; \"auto\" (\d+\.\d+)x \(",
        "step-14b-h200.json",
        STEP,
    ),
    Figures(
        "docs/performance.md",
        r"\| f = 1/4 \*\*(\d+\.\d+)x\*\* less time than microsoft/dion's Muon, (\d+\.\d+)x less than microsoft/dion's Dion3 at f = 1/4 \|",
        "fsdp2-step-h200.json",
        FSDP2,
    ),
    Figures(
        "docs/performance.md",
        r"total over 8 shapes \*\*(\d+\.\d+)x\*\* less time than Muon's NS5 eager; (\d+\.\d+)x less than the same Gram Newton-Schulz on "
        r"quack's kernels eager \(per shape (\d\.\d\d)-(\d\.\d\d)x\), (\d+\.\d+)x graphed",
        "gram-ns-h200.json",
        ("total_ratios/eager: ours vs muon", "total_ratios/eager: ours vs quack", *ORTHO_QUACK, "total_ratios/graph: ours vs quack"),
    ),
    Figures(
        "docs/performance.md",
        r"f = 1/4 \*\*(\d+\.\d+)x\*\* and \*\*(\d+\.\d+)x\*\* less \(two calls\), \+(\d+\.\d+) and \+(\d+\.\d+) ms above Adam; "
        r"\"auto\" \(f = 1 at this width\) \+(\d+\.\d+) ms above Adam",
        "megatron-lm-350m-1xh200.json",
        MEGATRON,
    ),
    Figures(
        "docs/performance.md",
        r"f = 1/4 adds \*\*(\d+\.\d+) ms\*\* to AdamW's (\d+\.\d+); DeepSpeed's Muon adds (\d+\.\d+) \((\d+\.\d+)x more\)",
        "hf-trainer-25m-1xh100.json",
        (*TRAINER, "muon_over_dion3"),
    ),
    Figures(
        "docs/performance.md",
        r"10\.8M byte GPT.*?" + CONVERGENCE_ROW.format(r" f = 1/2 ([-+]\d\.\d+);"),
        "convergence-summary.json",
        (SMALL_AUTO, SMALL_HALF, SMALL_QUARTER, SMALL_EIGHTH, SMALL_ADAMW),
    ),
    Figures(
        "docs/performance.md",
        r"48\.7M byte GPT.*?" + CONVERGENCE_ROW.format(""),
        "convergence-summary.json",
        (MEDIUM_AUTO, MEDIUM_QUARTER, MEDIUM_EIGHTH, MEDIUM_ADAMW),
    ),
    Figures(
        "docs/performance.md",
        r"Median iteration: AdamW (\d+\.\d+) ms, Dion3 f = 1/4 (\d+\.\d+) ms \(\*\*\+(\d+\.\d+)\*\*\), DeepSpeed's Muon (\d+\.\d+) ms\s+"
        r"\(\*\*\+(\d+\.\d+)\*\*\): Dion3 adds (\d+\.\d+)x less\. Train loss \(mean of the last 10 steps\) "
        r"Dion3 (\d\.\d+), Muon (\d\.\d+),\s+AdamW (\d\.\d+)",
        "hf-trainer-25m-1xh100.json",
        (
            "iteration_ms/adamw",
            "iteration_ms/dion3 f=1\\/4",
            "above_adamw_ms/dion3 f=1\\/4",
            "iteration_ms/muon",
            "above_adamw_ms/muon",
            "muon_over_dion3",
            "train_loss_mean_last_10_steps/dion3 f=1\\/4",
            "train_loss_mean_last_10_steps/muon",
            "train_loss_mean_last_10_steps/adamw",
        ),
    ),
    Figures(
        "docs/performance.md",
        r"took \*\*(\d+\.\d+) ms against\s+Adam's (\d+\.\d+) \(\+(\d+\.\d+) ms\)\*\*, where f = 1/4 took (\d+\.\d+) ms",
        "megatron-lm-350m-1xh200.json",
        (
            "measurements/1/optimizer_ms/dion3 auto",
            "measurements/1/optimizer_ms/adam",
            "measurements/1/minus_adam_ms/dion3 auto",
            "measurements/1/optimizer_ms/dion3 f=1\\/4",
        ),
    ),
    Figures(
        "docs/performance.md",
        r"At f = 1/4 the step takes (\d+\.\d+)x less time than microsoft/dion's at the 14B shapes and (\d+\.\d+)x less at\s+the 350M ones",
        "fsdp2-step-h200.json",
        ("runs/14b/ours_f_quarter_vs_microsoft_dion3", "runs/350m/ours_f_quarter_vs_microsoft_dion3"),
    ),
    Figures(
        "docs/performance.md",
        r"step timed alone\s+was (\d+\.\d+)x \(auto\), (\d+\.\d+)x \(f = 1/4\) and (\d+\.\d+)x \(f = 1/8\) cheaper than Muon's",
        "convergence-summary.json",
        tuple(p.removesuffix("vs_muon") + "optimizer_step_vs_muon" for p in (MEDIUM_AUTO, MEDIUM_QUARTER, MEDIUM_EIGHTH)),
    ),
    Figures(
        "docs/performance.md",
        r"where it was (\d\.\d\d)x of quack in the table's run and (\d\.\d\d)x and (\d\.\d\d)x in two runs of\s+that shape alone",
        "gram-ns-h200.json",
        ("ratios/16x1024x5120/eager: ours vs quack", "kv_batch_repeats/eager: ours vs quack/0", "kv_batch_repeats/eager: ours vs quack/1"),
    ),
    # bf16 momentum against fp32 momentum, the convergence protocol's runs.
    *(
        Figures(
            "docs/performance.md",
            rf"\| {label} \| (\d\.\d+) \((\d\.\d+), (\d\.\d+)\) \| (\d\.\d+) \((\d\.\d+), (\d\.\d+)\) \| ([+-]\d\.\d+) \| (\d\.\d+) \|",
            BF16_MOMENTUM,
            (
                lambda data, f=f: statistics.mean(bf16_runs(data, f, "fp32")),
                lambda data, f=f: bf16_runs(data, f, "fp32")[0],
                lambda data, f=f: bf16_runs(data, f, "fp32")[1],
                lambda data, f=f: statistics.mean(bf16_runs(data, f, "bf16")),
                lambda data, f=f: bf16_runs(data, f, "bf16")[0],
                lambda data, f=f: bf16_runs(data, f, "bf16")[1],
                lambda data, f=f: statistics.mean(bf16_runs(data, f, "bf16")) - statistics.mean(bf16_runs(data, f, "fp32")),
                lambda data, f=f: abs(bf16_runs(data, f, "fp32")[0] - bf16_runs(data, f, "fp32")[1]),
            ),
        )
        for f, label in ((1.0, "f = 1"), (0.25, "f = 1/4"))
    ),
    Figures(
        "docs/performance.md",
        r"took (\d\.\d\d) ms against (\d\.\d\d) \(f = 1\) and (\d\.\d\d) against (\d\.\d\d) \(f = 1/4\) at\s+"
        r"this width \(medians over the seeds\)",
        BF16_MOMENTUM,
        tuple(
            (lambda data, f=f, mom=mom: statistics.median(bf16_runs(data, f, mom, "opt_ms")))
            for f in (1.0, 0.25)
            for mom in ("bf16", "fp32")
        ),
    ),
    # bench_step's memory on an 80 GB GPU, measured.
    Figures(
        "docs/performance.md",
        r"ran 4 layers, and they took (\d+\.\d) GiB reserved\s+at the peak \((\d+\.\d) GiB allocated\) against the (\d+\.\d) GiB estimated",
        "step-14b-before-after-1xh100.json",
        ("memory_gib/peak_reserved", "memory_gib/peak_allocated", "memory_gib/estimated/total"),
    ),
    # Dion3's state offloaded to host memory against it on the GPU, and AdamW stepped on the host.
    Figures(
        "docs/performance.md",
        r"8 layers of 14B shapes \((\d\.\d\d)B parameters, f = 1/4, fp32 momentum: (\d+\.\d\d) GiB of\s+state\)",
        OFFLOAD,
        (lambda data: data["parameters"] / 1e9, "state_gib"),
    ),
    Figures(
        "docs/performance.md",
        r"\| Dion3, state on the GPU \(one CUDA graph\) \| (\d+\.\d\d) ms \| (\d+\.\d\d) GiB \| (\d+\.\d\d) GiB \|\n"
        r"\| Dion3, `offload=True` \| (\d+\.\d\d) ms \| (\d+\.\d\d) GiB \| (\d+\.\d\d) GiB \|\n"
        r"\| AdamW offloaded as Megatron's `HybridDeviceOptimizer` steps it [^|]*\| (\d+\.\d\d) ms \| \| \|\n"
        r"\| AdamW offloaded as DeepSpeed's ZeRO-Offload steps it [^|]*\| (\d+\.\d\d) ms \|",
        OFFLOAD,
        (
            "dion3_on_gpu_ms",
            "memory/on_gpu/between_steps_gib",
            "memory/on_gpu/peak_during_step_gib",
            "dion3_offloaded_ms",
            "memory/offloaded/between_steps_gib",
            "memory/offloaded/peak_during_step_gib",
            "adamw_offloaded_ms",
            "deepspeed_cpu_adam_ms",
        ),
    ),
    Figures(
        "docs/performance.md",
        r"takes (\d\.\d\d)x the on-GPU one: it moves the state both ways, which at the host\s+link's measured "
        r"(\d+\.\d\d) GiB/s to the GPU and (\d+\.\d\d) GiB/s back takes (\d+\.\d) ms",
        OFFLOAD,
        ("offloaded_vs_on_gpu", "link_gib_per_s/to_gpu", "link_gib_per_s/to_host", "state_round_trip_ms_at_link"),
    ),
    Figures(
        "docs/performance.md",
        r"It is (\d\.\d\d)x faster than stepping AdamW\s+on the host with torch's fused AdamW, "
        r"and (\d\.\d\d)x faster than with DeepSpeed's CPU Adam",
        OFFLOAD,
        (
            lambda data: data["adamw_offloaded_ms"] / data["dion3_offloaded_ms"],
            lambda data: data["deepspeed_cpu_adam_ms"] / data["dion3_offloaded_ms"],
        ),
    ),
    # FSDP2's CPUOffloadPolicy: Dion3's step on the host and streamed through the GPU, against AdamW.
    Figures(
        "docs/performance.md",
        r"\| Dion3 f = 1/4 \| GPU \| (\d+\.\d\d) ms \|\n\| AdamW \(torch, foreach\) \| GPU \| (\d+\.\d\d) ms \|\n"
        r"\| Dion3 f = 1/4, `CPUOffloadPolicy` \| host, (\d+) cores \| (\d+\.\d\d) ms \|\n"
        r"\| Dion3 f = 1/4, `CPUOffloadPolicy`, `offload=True` \| GPU, streamed \| (\d+\.\d\d) ms \|\n"
        r"\| AdamW \(torch, foreach\), `CPUOffloadPolicy` \| host, (\d+) cores \| (\d+\.\d\d) ms \|",
        CPU_OFFLOAD_POLICY,
        (
            "ms/Dion3 f=1\\/4",
            "ms/AdamW (torch, foreach)",
            "cpu/torch_threads",
            "ms/Dion3 f=1\\/4, CPUOffloadPolicy",
            "ms/Dion3 f=1\\/4, CPUOffloadPolicy, offload=True",
            "cpu/torch_threads",
            "ms/AdamW (torch, foreach), CPUOffloadPolicy",
        ),
    ),
    Figures(
        "docs/performance.md",
        r"On the host, Dion3's step takes (\d+\.\d)x AdamW's and (\d+)x its own step on the GPU.*\n.*\n"
        r"Streamed through the GPU with `offload=True` it takes (\d+\.\d)x less than on the host and (\d\.\d\d)x AdamW's",
        CPU_OFFLOAD_POLICY,
        (
            lambda data: data["ms"]["Dion3 f=1/4, CPUOffloadPolicy"] / data["ms"]["AdamW (torch, foreach), CPUOffloadPolicy"],
            lambda data: data["ms"]["Dion3 f=1/4, CPUOffloadPolicy"] / data["ms"]["Dion3 f=1/4"],
            lambda data: data["ms"]["Dion3 f=1/4, CPUOffloadPolicy"] / data["ms"]["Dion3 f=1/4, CPUOffloadPolicy, offload=True"],
            lambda data: data["ms"]["Dion3 f=1/4, CPUOffloadPolicy, offload=True"] / data["ms"]["AdamW (torch, foreach), CPUOffloadPolicy"],
        ),
    ),
    Figures(
        "docs/fsdp2.md",
        r"Dion3's step at f = 1/4\s+took (\d+\.\d\d) ms on the host against torch AdamW's (\d+\.\d\d) ms there \((\d+\.\d)x\); "
        r"with `offload=True`\s+(\d+\.\d\d) ms, and (\d+\.\d\d) ms on the GPU without the policy",
        CPU_OFFLOAD_POLICY,
        (
            "ms/Dion3 f=1\\/4, CPUOffloadPolicy",
            "ms/AdamW (torch, foreach), CPUOffloadPolicy",
            lambda data: data["ms"]["Dion3 f=1/4, CPUOffloadPolicy"] / data["ms"]["AdamW (torch, foreach), CPUOffloadPolicy"],
            "ms/Dion3 f=1\\/4, CPUOffloadPolicy, offload=True",
            "ms/Dion3 f=1\\/4",
        ),
    ),
    Figures(
        "docs/fsdp2.md",
        r"the step at f = 1/4 takes (\d+\.\d\d) ms\s+against (\d+\.\d\d) ms for microsoft/dion's Dion3 and (\d+\.\d\d) ms for its Muon",
        "fsdp2-step-h200.json",
        ("runs/14b/ms/Dion3 f=1\\/4", "runs/14b/ms/microsoft\\/dion Dion3 f=1\\/4", "runs/14b/ms/microsoft\\/dion Muon"),
    ),
    Figures(
        "docs/performance.md",
        r"\(offload-14b-1xh100\.json\): (\d+\.\d) GiB of parameters and gradients",
        OFFLOAD,
        (lambda data: data["parameters"] * 8 / 2**30,),  # fp32 parameters and gradients
    ),
    # The step's host cost per matrix on CPU, against AdamW (foreach).
    Figures(
        "docs/performance.md",
        r"Dion3 took \*\*(\d\.\d\d)x\*\* AdamW's time at 3,000 matrices\s+\((\d+\.\d) against (\d+\.\d) us\), "
        r"(\d\.\d\d)x at 300 and (\d\.\d\d)x at 30",
        "host-cost-cpu.json",
        (
            "measurements/3000/dion3 \\/ adamw",
            "measurements/3000/dion3 us per matrix",
            "measurements/3000/adamw us per matrix",
            "measurements/300/dion3 \\/ adamw",
            "measurements/30/dion3 \\/ adamw",
        ),
    ),
    # The Megatron-Core GPT example on CPU, in the README and on the performance page.
    Figures(
        "README.md",
        r"Without `--steps` it runs 400 steps \((\d+\.\d) minutes on 2 CPU cores, (\d+\.\d) on 2 cores\s+loaded by other work; "
        r"validation loss (\d\.\d+)\)",
        "pretrain-gpt-cpu.json",
        (CPU_MINUTES(1), CPU_MINUTES(0), "measurements/0/final_validation_loss"),
    ),
    Figures(
        "docs/performance.md",
        r"ended at validation loss (\d\.\d+) in (\d+\.\d) minutes on cores loaded by other\s+work \(2026-12-07; (\d+\.\d) minutes when "
        r"it ran with `--decoupled-lr 0\.003`, the same arithmetic, on\s+2026-12-04, to validation loss (\d\.\d+)\)",
        "pretrain-gpt-cpu.json",
        ("measurements/0/final_validation_loss", CPU_MINUTES(0), CPU_MINUTES(1), "measurements/1/final_validation_loss"),
    ),
    Figures("docs/performance.md", r"--compare --decoupled-lr 0\.003` took (\d+\.\d) minutes", "pretrain-gpt-cpu.json", (CPU_MINUTES(2),)),
    Figures(
        "docs/performance.md",
        r"--compare --decoupled-lr 0\.003` took [^`]*`Dion3 f=auto: validation loss (\d\.\d+) vs Muon (\d\.\d+) \((-\d\.\d+)\), "
        r"AdamW (\d\.\d+);\s+optimizer step (\d+\.\d)x slower than Muon \((\d+\.\d+) vs (\d+\.\d+) ms",
        "pretrain-gpt-compare-cpu.json",
        (
            COMPARED("final_val_loss", "dion3"),
            COMPARED("final_val_loss", "muon"),
            lambda d: COMPARED("final_val_loss", "dion3")(d) - COMPARED("final_val_loss", "muon")(d),
            COMPARED("final_val_loss", "adam"),
            lambda d: COMPARED("optimizer_ms", "dion3")(d) / COMPARED("optimizer_ms", "muon")(d),
            COMPARED("optimizer_ms", "dion3"),
            COMPARED("optimizer_ms", "muon"),
        ),
    ),
    # docs/tuning.md: the table of f, its losses and its step ratios.
    *(
        Figures("docs/tuning.md", rf"\| {f} [^|]*\| ([-+]\d\.\d+) / ([-+]\d\.\d+) \|", "convergence-summary.json", (small, medium))
        for f, small, medium in (
            ("1", SMALL_AUTO, MEDIUM_AUTO),
            ("1/4", SMALL_QUARTER, MEDIUM_QUARTER),
            ("1/8", SMALL_EIGHTH, MEDIUM_EIGHTH),
        )
    ),
    *(
        Figures("docs/tuning.md", rf"\| {f} [^|]*\| [^|]* \| (\d+\.\d+)x less", "step-14b-h200.json", (step,))
        for f, step in (("1", STEP[2]), ("1/4", STEP[0]), ("1/8", STEP[1]))
    ),
    Figures("docs/tuning.md", r"\| 1/2 \| ([-+]\d\.\d+) / not measured \|", "convergence-summary.json", (SMALL_HALF,)),
    Figures("docs/tuning.md", r"\| 1/2 \|[^|]*\|[^|]*: (\d+\.\d+)x with f = 1 on the rest", "step-14b-h200.json", (STEP[3],)),
]


# docs/memory.md: its table, which is every case of benchmarks/bench_memory.py's results in the
# order measured and nothing else (the passage is the whole table), and the figures its text gives.
MEMORY = "memory-cpu.json"
MEMORY_TORCH, MEMORY_TORCH_NO_AGES = "Dion3, f = 1/4 (torch `Dion3`)", "Dion3, f = 1/4, staleness 0 (torch `Dion3`)"
MEMORY_ZERO, MEMORY_ZERO_NO_AGES = "Dion3, f = 1/4 (DeepSpeed ZeRO-1)", "Dion3, f = 1/4, staleness 0 (DeepSpeed ZeRO-1)"
MEMORY_ZERO_BF16 = "Dion3, f = 1/4, bf16 momentum (DeepSpeed ZeRO-1)"
MEMORY_ZERO_BF16_NO_AGES = "Dion3, f = 1/4, bf16 momentum, staleness 0 (DeepSpeed ZeRO-1)"
MEMORY_ADAMW, MEMORY_MUON = "AdamW, fp32 moments (torch `AdamW`)", "Muon, fp32 momentum (`torch.optim.Muon`)"


def MEMORY_CASE(name: str, key: str, scale: float = 1.0) -> Callable[[Any], float]:  # noqa: N802 (a value path, like the constants)
    """A figure of one case of memory-cpu.json, by the case's name (divided by ``scale``)."""
    return lambda data: next(case[key] for case in data["cases"] if case["name"] == name) / scale


def loose(passage: str) -> str:
    """A passage whose every space may be any run of white space (a line break of the doc)."""
    return passage.replace(" ", r"\s+")


def memory_table() -> Figures:
    cases = [case["name"] for case in json.loads((RESULTS / MEMORY).read_text(encoding="utf-8"))["cases"]]
    header = (
        r"\| optimizer \(front end\) \| bytes per parameter of the model \| bytes per parameter of the hidden matrices \| MiB \|\n"
        r"\|---\|---\|---\|---\|\n"
    )
    rows = "".join(rf"\| {re.escape(name)} \| (\d+\.\d+) \| (\d+\.\d+) \| (\d+\.\d+) \|\n" for name in cases)
    values = tuple(
        value
        for name in cases
        for value in (
            MEMORY_CASE(name, "bytes per parameter"),
            MEMORY_CASE(name, "bytes per matrix parameter"),
            MEMORY_CASE(name, "bytes", 2**20),
        )
    )
    return Figures("docs/memory.md", header + rows + r"(?!\|)", MEMORY, values)


FIGURES += [
    memory_table(),
    Figures(
        "docs/memory.md",
        loose(
            r"(\d+) layers of width (\d+) \((\d+) heads, (\d+) key/value heads, a SwiGLU MLP of width (\d+), RMSNorms, "
            r"a (\d+)-token embedding tied to the output head\): (\d+\.\d)M parameters, (\d+\.\d)M of them in the hidden matrices"
        ),
        MEMORY,
        (
            *(f"model/shapes/{key}" for key in ("layers", "width", "heads", "kv_heads", "hidden", "vocab")),
            lambda data: data["model"]["parameters"] / 1e6,
            lambda data: data["model"]["hidden matrix parameters"] / 1e6,
        ),
    ),
    Figures(
        "docs/memory.md",
        loose(
            r"(\d\.\d+) bytes per parameter of these matrices \((\d\.\d+) with `staleness=0`\), where Muon's one fp32 momentum "
            r"takes (\d\.\d+)\. Over the whole model, with AdamW's state of the embedding, that is (\d\.\d+) bytes per parameter "
            r"against AdamW's (\d\.\d+)"
        ),
        MEMORY,
        (
            MEMORY_CASE(MEMORY_TORCH, "bytes per matrix parameter"),
            MEMORY_CASE(MEMORY_TORCH_NO_AGES, "bytes per matrix parameter"),
            MEMORY_CASE(MEMORY_MUON, "bytes per matrix parameter"),
            MEMORY_CASE(MEMORY_TORCH, "bytes per parameter"),
            MEMORY_CASE(MEMORY_ADAMW, "bytes per parameter"),
        ),
    ),
    Figures(
        "docs/memory.md",
        loose(r"the math staying in fp32: (\d\.\d+) bytes per parameter of the hidden matrices, (\d\.\d+) over\s+the whole model"),
        MEMORY,
        (
            MEMORY_CASE("Dion3, f = 1/4, bf16 momentum (torch `Dion3`)", "bytes per matrix parameter"),
            MEMORY_CASE("Dion3, f = 1/4, bf16 momentum (torch `Dion3`)", "bytes per parameter"),
        ),
    ),
    Figures(
        "docs/memory.md",
        loose(r"That is (\d+\.\d+) bytes per parameter of the model with staleness, and (\d\.\d+) with `staleness=0`"),
        MEMORY,
        (MEMORY_CASE(MEMORY_ZERO, "bytes per parameter"), MEMORY_CASE(MEMORY_ZERO_NO_AGES, "bytes per parameter")),
    ),
    Figures(
        "docs/memory.md",
        loose(
            r"param group in bf16: (\d+\.\d+) bytes per parameter of the hidden matrices \((\d\.\d+) with `staleness=0`\), "
            r"(\d+\.\d+) over the whole model"
        ),
        MEMORY,
        (
            MEMORY_CASE(MEMORY_ZERO_BF16, "bytes per matrix parameter"),
            MEMORY_CASE(MEMORY_ZERO_BF16_NO_AGES, "bytes per matrix parameter"),
            MEMORY_CASE(MEMORY_ZERO_BF16, "bytes per parameter"),
        ),
    ),
]


def figure_problems(figures: Figures, text: str | None = None) -> list[str]:
    text = (ROOT / figures.doc).read_text(encoding="utf-8") if text is None else text
    found = re.search(figures.passage, text, re.S)
    if not found:
        return [f"{figures.doc}: no passage {figures.passage[:70]!r}"]
    data = json.loads((RESULTS / figures.result).read_text(encoding="utf-8"))
    problems = []
    for written, value in zip(found.groups(), figures.values):
        expected = value(data) if callable(value) else at(data, value)
        if not states(written, expected):
            problems.append(f"{figures.doc}: {written} in {found.group(0)[:60]!r}..., but {figures.result} has {expected}")
    return problems


def test_every_figure_is_its_json_value_at_the_precision_written():
    docs = {"README.md", "docs/performance.md", "docs/tuning.md", "docs/memory.md", "docs/fsdp2.md"}
    assert len(FIGURES) >= 25 and {f.doc for f in FIGURES} == docs
    for figures in FIGURES:
        assert len(figures.values) == re.compile(figures.passage).groups, figures.passage
    problems = [p for figures in FIGURES for p in figure_problems(figures)]
    assert not problems, "\n".join(problems)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(figure_problems(FIGURES[2], readme.replace("17.92x", "17.93x"))) == 1
    assert figure_problems(FIGURES[2], readme.replace("| Muon |", "| NS5 |"))  # a passage that is gone fails too
    assert (
        states("1.80", 1.8)
        and states("-0.0066", -0.0066)
        and not states("+0.0067", -0.0067)
        and states("8.9", 8.92)
        and not states("8.93", 8.92)
    )


# ------------------------------------------------------------------------------------------------
# Which figures are older: docs/performance.md's "Older figures" section holds exactly the results
# marked older in benchmarks/results/README.md, the README names exactly its layouts, and a link
# to an older figure anywhere says so.

PERFORMANCE = ROOT / "docs" / "performance.md"
OLDER = "older-figures"
RESULT_LINK = re.compile(r"benchmarks/results/([\w.-]+\.json)\)")
PERFORMANCE_LINK = re.compile(
    r"\[([^\]]+)\]\((?:https://github\.com/dion3-megatron/dion3-megatron/blob/main/docs/)?performance\.md#([\w-]+)\)"
)


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(path: pathlib.Path) -> dict[str, tuple[int, str]]:
    """Each heading's anchor: (its level, its text up to the next heading of its level or above)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found = {}
    for i, line in enumerate(lines):
        heading = re.match(r"^(#+) (.+)$", line)
        if heading:
            level = len(heading.group(1))
            end = next((j for j in range(i + 1, len(lines)) if re.match(rf"^#{{1,{level}}} ", lines[j])), len(lines))
            found[anchor(heading.group(2))] = (level, "\n".join(lines[i:end]))
    return found


def older_anchors() -> set[str]:
    """The subsections of "Older figures"."""
    level, text = sections(PERFORMANCE)[OLDER]
    return {anchor(h) for h in re.findall(rf"^#{{{level + 1}}} (.+)$", text, re.M)}


def marked_older() -> set[str]:
    rows = re.findall(r"^\|.*\|$", (RESULTS / "README.md").read_text(encoding="utf-8"), re.M)
    return {name for row in rows if "*(older)*" in row for name in re.findall(r"\[([\w.-]+\.json)\]", row)}


def test_the_older_section_holds_exactly_the_results_marked_older():
    all_sections = sections(PERFORMANCE)
    older_text = all_sections[OLDER][1]
    cited_older = set(RESULT_LINK.findall(older_text))
    cited_elsewhere = set(RESULT_LINK.findall(PERFORMANCE.read_text(encoding="utf-8").replace(older_text, "")))
    assert len(older_anchors()) == 3 and cited_older
    assert cited_older <= marked_older(), cited_older - marked_older()
    assert not cited_elsewhere & marked_older(), cited_elsewhere & marked_older()
    for name in cited_older:
        assert re.fullmatch(r"[0-9a-f]{7,40}", json.loads((RESULTS / name).read_text(encoding="utf-8")).get("code_revision", "")), name


def older_link_problems(path: pathlib.Path, text: str | None = None) -> list[str]:
    """A link to an older figure is labelled older (in its text or its sentence before it), and a
    link labelled older leads to one."""
    text = path.read_text(encoding="utf-8") if text is None else text
    older = older_anchors() | {OLDER}
    problems = []
    for match in PERFORMANCE_LINK.finditer(text):
        label, target = match.groups()
        sentence = re.split(r"\.\s|\n\n|\||;", text[: match.start()])[-1]
        says_older = "older" in (sentence + label).lower()
        if (target in older) != says_older:
            problems.append(f"{path.relative_to(ROOT)}: [{label}](...#{target}) {'is' if target in older else 'is not'} an older figure")
    return problems


def test_links_to_older_figures_say_so_and_only_those():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [p for page in pages for p in older_link_problems(page)]
    assert not problems, "\n".join(problems)
    sample = "timed with this release: [Trainer](performance.md#deepspeed-zero-1-606m-two-gpus); [older](performance.md#convergence)"
    assert len(older_link_problems(ROOT / "README.md", sample)) == 2


def test_the_readme_names_exactly_the_older_layouts():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    paragraph = next(p for p in readme.split("\n\n") if "code revisions whose optimizer step differs" in p)
    named = {target for _, target in PERFORMANCE_LINK.findall(paragraph)} & (older_anchors() | {OLDER})
    assert named == older_anchors(), named ^ older_anchors()


# ------------------------------------------------------------------------------------------------
# Each section of docs/performance.md that cites results states their GPU, date and versions.


def stated_machines(data: dict) -> set[str]:
    """The GPU models a result names as its machine, or CPU."""
    where = " ".join(str(source.get(k, "")) for source in (data, data.get("meta", {})) for k in ("gpu", "machine", "device"))
    return {g for g in ("H100", "H200") if g in where} or {"CPU"}


def stated_dates(data: dict) -> set[str]:
    text = json.dumps({k: v for k, v in data.items() if k in ("date", "dates", "measurements", "meta")})
    return set(re.findall(r"20\d\d-\d\d-\d\d", text))


def provenance_problems(name: str, section_text: str) -> list[str]:
    data = json.loads((RESULTS / name).read_text(encoding="utf-8"))
    problems = []
    for machine in sorted(stated_machines(data)):
        if machine not in section_text:
            problems.append(f"{name}: its section does not name its machine, {machine}")
    dates = stated_dates(data)
    if not dates or not any(d in section_text for d in dates):
        problems.append(f"{name}: its section gives none of its dates {sorted(dates)}")
    for package, version in {**data.get("versions", {}), **({"torch": data["torch"]} if "torch" in data else {})}.items():
        number = re.match(r"\d+(?:\.\d+)+", str(version))
        named = re.findall(rf"{re.escape(package)},?\s+(\d+(?:\.\d+)+)", section_text)
        if number and named and number.group(0) not in named:
            problems.append(f"{name}: its section gives {package} {named}, the JSON {version}")
    return problems


MEMORY_PAGE = ROOT / "docs" / "memory.md"


def test_every_section_citing_results_states_their_machine_date_and_versions():
    checked = 0
    for level, text in (section for page in (PERFORMANCE, MEMORY_PAGE) for section in sections(page).values()):
        if level < 2:
            continue
        own = text if level == 3 else re.split(r"^### ", text, flags=re.M)[0]
        for name in set(re.findall(r"Raw:\s+\[([\w.-]+\.json)\]", own)):
            problems = provenance_problems(name, own)
            assert not problems, "\n".join(problems)
            checked += 1
    assert checked >= 15
    hf = sections(PERFORMANCE)["hugging-face-trainer--deepspeed-zero-1-25m-one-gpu"][1]
    assert len(provenance_problems("hf-trainer-25m-1xh100.json", hf.replace("H100", "H200").replace("5.17.0", "5.16.0"))) == 2


# ------------------------------------------------------------------------------------------------
# Constants the docs give: a model's chosen constant says so and is the code's; a fitted or measured
# one is derived here from its results.

TUNING = ROOT / "docs" / "tuning.md"
SCALING = ROOT / "docs" / "scaling.md"


def number(text: str) -> float:
    return float(text.replace(",", ""))


def two_figures(n: int) -> int:
    """n rounded to two significant figures, as the docs write "about" a width."""
    return round(n, 2 - len(str(n)))


def loss_per_waiting_row_share(summary: dict) -> float:
    """The largest (loss at f - loss at f = 1) / (1/f - 1) of the convergence study."""
    per_unit = []
    for size in summary["sizes"].values():
        families = size["vs_muon"]
        at_one = next(v["final"] for k, v in families.items() if k.startswith("dion3 auto"))
        for family, result in families.items():
            f = re.match(r"dion3 f = 1/(\d+)", family)
            if f:
                per_unit.append((result["final"] - at_one) / (int(f.group(1)) - 1))
    return max(per_unit)


def loss_per_log_time(summary: dict) -> tuple[float, float]:
    """The fall of Muon's validation loss per unit of ln(steps) over the last evaluation interval of
    its runs at its best lr: the smallest and the largest."""
    falls = []
    for size in summary["sizes"].values():
        raw = json.loads((RESULTS / size["raw"]).read_text(encoding="utf-8"))
        for run in raw["runs"]:
            if run["opt"] == "muon" and run["lr"] == size["muon"]["lr"]:
                every = run["val_loss"][1][0]
                (s0, l0), (s1, l1) = [(s, v) for s, v in run["val_loss"] if s and s % every == 0][-2:]
                falls.append((l0 - l1) / math.log(s1 / s0))
    assert len(falls) == 4, falls  # two sizes, two seeds
    return min(falls), max(falls)


def test_the_auto_fractions_loss_constants_are_fitted_to_the_convergence_study():
    from dion3_megatron.core import cost_model

    text = TUNING.read_text(encoding="utf-8")
    per_row, per_log = re.search(
        r"Each f costs about (0\.\d+) x \(1/f - 1\) nats.*?worth about\s+(0\.\d+) x ln\(speed-up\)", text, re.S
    ).groups()
    assert number(per_row) == cost_model.LOSS_PER_WAITING_ROW_SHARE and number(per_log) == cost_model.LOSS_PER_LOG_TIME
    step = " ".join(re.search(r"^3\. Each f costs.*?(?=\n\n)", text, re.S | re.M).group(0).split())
    assert (
        "(measured)" not in step and "`LOSS_PER_WAITING_ROW_SHARE` and `LOSS_PER_LOG_TIME` in `dion3_megatron/core/cost_model.py`" in step
    )
    assert "fitted to the convergence study" in step and "convergence-summary.json" in step and "convergence-medium.json" in step
    summary = json.loads((RESULTS / "convergence-summary.json").read_text(encoding="utf-8"))
    assert round(loss_per_waiting_row_share(summary), 4) == cost_model.LOSS_PER_WAITING_ROW_SHARE
    low, high = loss_per_log_time(summary)
    assert math.floor(low * 100) / 100 == cost_model.LOSS_PER_LOG_TIME
    comment = re.search(r"falls by (0\.\d+)-(0\.\d+) per unit of ln\(steps\)", inspect.getsource(cost_model))
    assert comment and (number(comment.group(1)), number(comment.group(2))) == (round(low, 2), round(high, 2))


def test_the_widths_where_auto_takes_a_half_are_the_models_at_the_stated_speed():
    from dion3_megatron.core import cost_model

    text = " ".join(TUNING.read_text(encoding="utf-8").split())
    flops, launch, memory = map(
        number, re.search(r"at a speed like an H200's \((\d+) TFLOP/s [^,]*, (\d+) us a launch, (\d+) TB/s", text).groups()
    )
    speed = cost_model.DeviceSpeed(flops * 1e12, launch * 1e-6, memory * 1e12, link_bytes_per_s=1e11)

    def first_below_one(shape: Callable[[int], tuple[int, int]], batch: int) -> int:
        widths = range(128, 20000)
        chosen = [cost_model.choose_fraction(*shape(n), speed, batch=batch) < 1 for n in widths[::16]]
        coarse = widths[::16][chosen.index(True)]
        return next(n for n in range(coarse - 16, coarse + 1) if cost_model.choose_fraction(*shape(n), speed, batch=batch) < 1)

    square = re.search(
        r"on square matrices from about ([\d,]+) wide for one matrix of a shape, ([\d,]+) for 8 of them and ([\d,]+) for 64", text
    )
    wide = re.search(r"on wide ones \(4 times as many columns as rows\) from about ([\d,]+) rows", text)
    tall = re.search(r"on tall ones \(4 times as many rows\) only from about ([\d,]+) columns", text)
    stated = [*map(number, square.groups()), number(wide.group(1)), number(tall.group(1))]
    computed = [
        *(first_below_one(lambda n: (n, n), batch) for batch in (1, 8, 64)),
        first_below_one(lambda n: (n, 4 * n), 1),
        first_below_one(lambda n: (4 * n, n), 1),
    ]
    assert stated == [two_figures(n) for n in computed], (stated, computed)
    assert "up to 8192 wide" in text and "never gives f = 1/4's step" in text
    shapes = [s for n in range(128, 8193, 64) for s in ((n, n), (n, 4 * n), (4 * n, n))]
    assert min(cost_model.choose_fraction(r, c, speed, batch=b) for r, c in shapes for b in (1, 8, 64)) == 0.5


def test_the_stated_auto_choices_are_the_measured_ones():
    text = " ".join(TUNING.read_text(encoding="utf-8").split())
    assert "On an H200 it chose f = 1 for every matrix of the study's models and of the 350M GPT" in text
    study = [
        f
        for name in ("convergence-small.json", "convergence-medium.json")
        for run in json.loads((RESULTS / name).read_text(encoding="utf-8"))["runs"]
        if run.get("f") == "auto"
        for fs in run["auto_fractions"].values()
        for f in fs
    ]
    megatron = json.loads((RESULTS / "megatron-lm-350m-1xh200.json").read_text(encoding="utf-8"))["measurements"][1]["auto_chose"]
    assert study and set(study) == {1.0} and set(megatron.values()) == {1}
    chose = json.loads((RESULTS / "step-14b-h200.json").read_text(encoding="utf-8"))["auto_chose"]
    stated = re.search(
        r"on the 14B shapes f = 1/2 for the square and wide matrices \(([^)]+)\)"
        r" and f = 1 for the tall MLP matrix \((\w+)\) and K/V \((\w+)\)",
        text,
    )
    assert {s: 0.5 for s in stated.group(1).split(", ")} | {stated.group(2): 1.0, stated.group(3): 1.0} == chose


def test_the_communication_models_constants_are_the_codes_and_its_ns_rate_is_measured():
    from benchmarks import comm_model

    text = " ".join(SCALING.read_text(encoding="utf-8").split())
    constants = re.search(
        r"alpha = (\d+) us \([^)]*\), beta = (\d+) GB/s \([^)]*\), HBM (\d+\.\d) TB/s \([^)]*\)"
        r" and (\d+) us per eager op are chosen, not measured here; "
        r"the NS rate, (\d+) TFLOP/s, is what plain-torch NS5 sustained on 5120 x 13824 on one H200, rounded down \((\d+\.\d+) ms for its "
        r"(\d+\.\d) TFLOP of dense products: (\d+) TFLOP/s; \[gram-ns-h200\.json\]",
        text,
    )
    assert constants, "docs/scaling.md: the model's constants, which are chosen and which measured"
    alpha, beta, hbm, launch, rate, ms, tflop, sustained = map(number, constants.groups())
    assert (alpha, beta, hbm, launch, rate) == (
        round(comm_model.ALPHA_S * 1e6),
        round(comm_model.BETA_BYTES_PER_S / 1e9),
        comm_model.HBM_BYTES_PER_S / 1e12,
        comm_model.LAUNCH_S * 1e6,
        comm_model.NS_FLOPS_PER_S / 1e12,
    )
    measured_ms = json.loads((RESULTS / "gram-ns-h200.json").read_text(encoding="utf-8"))["results_ms"]["5120x13824"]["muon eager"]
    flops = comm_model.dense_ns5_flops(5120, 13824)
    assert states(f"{ms:.2f}", measured_ms) and tflop == round(flops / 1e12, 1) and sustained == round(flops / (measured_ms * 1e-3) / 1e12)
    assert rate == math.floor(sustained / 10) * 10  # rounded down to ten


def test_the_readme_tables_rows_are_measured_on_the_gpus_its_header_names():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    header = next(line for line in readme.splitlines() if line.startswith("| measured on"))
    gpu = re.search(r"measured on NVIDIA (H\d00)s", header).group(1)
    rows = [line for line in readme.splitlines() if line.startswith("| [")]
    assert len(rows) >= 6
    for row in rows:
        (target,) = {t for _, t in PERFORMANCE_LINK.findall(row)}
        text = sections(PERFORMANCE)[target][1]
        names = set(re.findall(r"Raw:\s+\[([\w.-]+\.json)\]", text))
        assert names, row[:60]
        for name in names:
            assert gpu in stated_machines(json.loads((RESULTS / name).read_text(encoding="utf-8"))), (row[:60], name)


def test_the_cost_the_half_installed_kernels_warning_states_is_the_measured_one():
    """Gram Newton-Schulz on cuBLAS against the kernels, over the 14B shapes (eager)."""
    from dion3_megatron.kernels.symm import backend

    measured = json.loads((ROOT / "benchmarks" / "results" / "gram-ns-h200.json").read_text())
    assert f", {measured['total_ratios']['eager: ours vs gram-torch']:.2f}x the time" in backend.COST
    assert measured["gpu"].startswith("1 x NVIDIA H200") and "(14B shapes, one H200)" in backend.COST
