"""docs/performance.md's table of the GPU memory of each command: every documented GPU command has a
row, every estimate is what benchmarks/command_memory.py computes, and every "ran on" names a
results JSON whose GPU is that one."""

from __future__ import annotations

import json
import re
import sys

from integration.test_doc_commands import blocks_marked
from support.repository import ROOT

if str(ROOT / "benchmarks") not in sys.path:  # the benchmarks import each other as the scripts they are
    sys.path.insert(0, str(ROOT / "benchmarks"))

import command_memory  # noqa: E402
from step_memory import size_text  # noqa: E402

PAGE = ROOT / "docs" / "performance.md"
# how a row says where a command ran -> what that results JSON's "gpu" field holds
RAN_ON = re.compile(r"ran on (an 80 GB H100|an H200|2 H200s) \(([\w.-]+\.json)\)")
GPU_FIELD = {
    "an 80 GB H100": re.compile(r"^(1 x )?NVIDIA H100 80GB"),
    "an H200": re.compile(r"^1 x NVIDIA H200"),
    "2 H200s": re.compile(r"^2 x NVIDIA H200"),
}
NOT_RUNS = ("patch ",)  # a GPU block's patch command applies a patch: no GPU run


def table(text: str | None = None) -> dict[str, str]:
    """The table's rows: command cell (without its backticks) -> memory cell."""
    text = PAGE.read_text(encoding="utf-8") if text is None else text
    section = text[text.index("## GPU memory of each command") : text.index("## bench_step's memory on an 80 GB GPU")]
    rows = re.findall(r"^\| `(.+?)` \| (.+) \|$", section, re.M)
    return dict(rows)


def documented_gpu_commands() -> list[tuple[str, str]]:
    """(where, command) of each command of the blocks marked gpu, continuation lines joined."""
    commands = []
    for block in blocks_marked("gpu"):
        for command in block.text.replace("\\\n", " ").splitlines():
            command = " ".join(command.split())
            if command and not command.startswith("#") and not command.startswith(NOT_RUNS):
                commands.append((block.where, command))
    return commands


def matches(row: str, command: str) -> bool:
    """A row's command, "..." standing for what it leaves out, matches a command holding its pieces in order."""
    at = 0
    for piece in (p.strip() for p in row.split("...")):
        found = command.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return True


def unmatched(rows: dict[str, str], commands: list[tuple[str, str]]) -> list[str]:
    """The commands that match no row, or more than one."""
    problems = []
    for where, command in commands:
        hits = [row for row in rows if matches(row, command)]
        if len(hits) != 1:
            problems.append(f"{where}: {command[:100]} matches {len(hits)} rows {hits}")
    return problems


def test_every_documented_gpu_command_has_one_row():
    rows, commands = table(), documented_gpu_commands()
    assert len(commands) >= 25, commands
    assert not unmatched(rows, commands), "\n".join(unmatched(rows, commands))
    # the check can fail: a new command, and a changed flag of a documented one, match no row
    planted = [
        ("new.md:1", "torchrun --nproc-per-node 8 benchmarks/bench_new.py"),
        ("README.md:1", commands[0][1].replace("--num-layers 12", "--num-layers 48")),
    ]
    assert len(unmatched(rows, planted)) == 2


def training(name: str, prefix: str = "", note: str = "") -> str:
    """A training run's cell: the total, and its state and activations, each an estimate."""
    e = command_memory.estimates()[name]
    state, activations = size_text(e["state"]), size_text(e["activations"])
    return (
        f"{prefix}{size_text(e['total'])} (estimate{note}: {state} of weights, gradients and optimizer state, {activations} of activations)"
    )


LAUNCH = "python -m dion3_megatron.megatron.launch"
LAUNCH_8 = "torchrun --nproc-per-node 8 -m dion3_megatron.megatron.launch examples/megatron_lm_pretrain_gpt.py"
SHAPE_12 = "--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
SHAPE_8 = "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
SHAPE_4 = "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256"
LARGEST = ", for Adam's run, the largest of the three"


def expected_estimates() -> dict[str, str]:
    """Row command -> the memory cell that command_memory's estimates give, for every row that states one."""
    e = {name: size_text(parts["total"]) for name, parts in command_memory.estimates().items()}
    compare_350m = "ran on an H200 (megatron-lm-350m-1xh200.json); " + training("compare 350m gpus1", note=LARGEST)
    deepspeed = "deepspeed --num_gpus 2 examples/deepspeed/train_gpt.py --config examples/deepspeed"
    return {
        f"{LAUNCH} Megatron-LM/pretrain_gpt.py --optimizer dion3 --use-distributed-optimizer --bf16 --lr 0.01 --decoupled-lr 0.002"
        f" --mock-data ... {SHAPE_12} --micro-batch-size 8 ...": training("megatron-lm 12x1024"),
        f"{LAUNCH} Megatron-LM/pretrain_gpt.py ... --use-precision-aware-optimizer --optimizer-cpu-offload ... {SHAPE_12}"
        " --micro-batch-size 8 ...": training("megatron-lm 12x1024 offload", note=", Dion3's momentum in host memory"),
        f"{LAUNCH} Megatron-LM/pretrain_gpt.py ... --use-precision-aware-optimizer --exp-avg-dtype bf16 ... {SHAPE_12}"
        " --micro-batch-size 8 ...": training("megatron-lm 12x1024 bf16 momentum", note=", Dion3's momentum in bf16"),
        f"{LAUNCH} examples/megatron_lm_pretrain_gpt.py --optimizer dion3 --use-distributed-optimizer ... {SHAPE_4}"
        " --micro-batch-size 8 ...": training("example 4x256"),
        f"{LAUNCH_8} ... --tensor-model-parallel-size 2 ... {SHAPE_8} --micro-batch-size 8 ...": training(
            "example 8x1024 tp2", "per GPU: "
        ),
        f"{LAUNCH_8} --optimizer dion3 --use-torch-fsdp2 ... {SHAPE_8} --micro-batch-size 4 ...": training(
            "example 8x1024 fsdp2", "per GPU: "
        ),
        "GPUS=8 TP=2 SIZE=1.3b examples/megatron_lm/compare_on_gpus.sh": training("compare 1.3b gpus8 tp2", "per GPU: ", LARGEST),
        "GPUS=2 TP=2 RESUME=1 OPTS=dion3 examples/megatron_lm/compare_on_gpus.sh": training("compare 350m gpus2 tp2", "per GPU: "),
        "SCRIPT=Megatron-LM/pretrain_gpt.py GPUS=1 SIZE=350m ITERS=60 examples/megatron_lm/compare_on_gpus.sh": compare_350m,
        'OPTS="dion3 muon adam" GPUS=1 SIZE=350m ITERS=60 SCRIPT=Megatron-LM/pretrain_gpt.py ...'
        " bash examples/megatron_lm/compare_on_gpus.sh": compare_350m,
        f"{deepspeed}/ds_config_dion3.json": training("deepspeed zero1", "per GPU: "),
        f"{deepspeed}/ds_config_dion3_zero3.json": training("deepspeed zero3", "per GPU: "),
        "deepspeed --num_gpus 1 examples/hf_trainer/train.py --deepspeed examples/hf_trainer/ds_config_dion3.json ...": (
            training("hf deepspeed") + "; the same model at batch 16 ran on an 80 GB H100 (hf-trainer-25m-1xh100.json)"
        ),
        "torchrun --standalone --nproc-per-node 2 examples/fsdp2_train.py --steps 200 ...": training(
            "fsdp2_train", "per GPU: ", ", counted unsharded"
        ),
        "python benchmarks/bench_ortho.py": f"{e['bench_ortho']} (estimate: its largest shape's inputs and each variant's graphed"
        " orthogonalizations); ran on an H200 (gram-ns-h200.json)",
        "python benchmarks/bench_eager.py": f"{e['bench_eager']} (estimate: its largest inputs and their results);"
        " ran on an H200 (eager-launch-h200.json)",
        "torchrun --standalone --nproc-per-node 2 benchmarks/bench_megatron.py ... --optimizers dion3,muon,adam --steps 150"
        " --log-every 25": f"ran on 2 H200s (megatron-core-157m-2xh200.json); per GPU{LARGEST}: {e['bench_megatron tp2']} at"
        f" `--tp 2`, {e['bench_megatron tp1']} at `--tp 1` (estimate)",
        "PER_RUN_TIMEOUT=75 examples/deepspeed/compare_on_gpus.sh --width 2048 --layers 12 --heads 16 --seq 512 ...": (
            "ran on 2 H200s (deepspeed-606m-2xh200.json); "
            + training("deepspeed 606m", "per GPU on 2 GPUs: ", ", for AdamW's run, the largest of the three")
        ),
        "torchrun --standalone --nproc-per-node 2 benchmarks/bench_megabatch.py": f"ran on 2 H200s (megabatch-1.2b-2xh200.json);"
        f" per GPU: {e['bench_megabatch']} (estimate: fp32 weight, gradient and momentum shards, a gathered fp32 copy of every"
        " matrix and their orthogonalization at f = 1)",
        "torchrun --standalone --nproc-per-node 4 benchmarks/comm_fsdp2.py --measure ...": "none: its ranks run on CPU, over gloo"
        " (comm-fsdp2-model.json)",
        "torchrun --nproc-per-node 1 -m torchtitan.train --module dion3_megatron.torchtitan --config llama3_debugmodel_dion3": (
            training("torchtitan dion3")
        ),
        "python benchmarks/bench_torchtitan.py ...": training("torchtitan adamw", note=", for the AdamW run, the larger"),
    }


def test_every_estimate_in_the_table_is_the_computed_one():
    rows, expected = table(), expected_estimates()
    for command, cell in expected.items():
        assert rows.get(command) == cell, (command, rows.get(command), cell)
    # the check can fail: a figure edited in the page differs from the computed one
    edited = PAGE.read_text(encoding="utf-8").replace(expected["python benchmarks/bench_eager.py"], "1.0 GiB (estimate)")
    assert table(edited)["python benchmarks/bench_eager.py"] != expected["python benchmarks/bench_eager.py"]


def ran_on_problems(rows: dict[str, str]) -> list[str]:
    problems, seen = [], 0
    for command, cell in rows.items():
        if "ran on" in cell and not RAN_ON.search(cell):
            problems.append(f"{command}: 'ran on' names no GPU and results JSON")
        for gpu, name in RAN_ON.findall(cell):
            seen += 1
            field = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["gpu"]
            if not GPU_FIELD[gpu].search(field):
                problems.append(f"{command}: ran on {gpu}, but {name}'s gpu is {field!r}")
    return problems if seen >= 8 else [*problems, f"only {seen} 'ran on' rows"]


def test_every_ran_on_matches_its_results_json():
    rows = table()
    assert not ran_on_problems(rows), "\n".join(ran_on_problems(rows))
    comm = json.loads((ROOT / "benchmarks" / "results" / "comm-fsdp2-model.json").read_text())["measured_small_case"]
    assert "gloo" in comm["machine"] and "CPU" in comm["machine"]
    # the check can fail: an H100 said where the JSON says H200, and a "ran on" without its JSON
    wrong = {"a": "ran on an 80 GB H100 (gram-ns-h200.json)", "b": "ran on an H200 (megabatch-1.2b-2xh200.json)", "c": "ran on an H100"}
    assert len(ran_on_problems({**rows, **wrong})) == 3
