"""Where Dion3's optimizer step spends its time inside Megatron or DeepSpeed training.

Wraps the phases of the step (finite check, shard refresh, the engine and its per-shape-group
parts, the ZeRO plan, the matrices held whole) with timers between two device synchronizations,
runs a training harness unchanged, and prints each phase's median on rank 0; one step (the
``--profile-call``-th engine step) also runs under torch.profiler, which prints its aten-op count
and the top kernels. The synchronizations change what they measure a little (no overlap across
phases): read the numbers as a breakdown, not as the step time.

    torchrun --standalone --nproc-per-node 2 benchmarks/step_phases.py megatron --tp 2 --optimizers dion3 \\
        --layers 12 --hidden 2048 --heads 16 --ffn 5632 --steps 30
    torchrun --standalone --nproc-per-node 2 benchmarks/step_phases.py deepspeed \\
        examples/deepspeed/train_gpt.py --config examples/deepspeed/ds_config_dion3.json --width 2048 --layers 12 --steps 16
    torchrun --nproc-per-node 1 benchmarks/step_phases.py pretrain \\
        examples/megatron_lm_pretrain_gpt.py --optimizer dion3 --use-distributed-optimizer ...

Everything after the harness name goes to the harness (``benchmarks/bench_megatron.py``; the
given DeepSpeed training script; or, for ``pretrain``, a Megatron-LM training script run through
``python -m dion3_megatron.megatron.launch``, i.e. ``megatron.training.pretrain()``'s layout).
"""

from __future__ import annotations

import collections
import os
import runpy
import statistics
import sys
import time
from typing import Callable

import torch

from dion3_megatron.engine import Dion3Engine, exchange, general, local, planned, static

TIMES: dict[str, list[float]] = collections.defaultdict(list)
PROFILE_CALL = int(os.environ.get("STEP_PHASES_PROFILE_CALL", "10"))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rank0() -> bool:
    """The rank that prints (every rank with STEP_PHASES_ALL_RANKS=1: to find a straggler)."""
    return int(os.environ.get("RANK", "0")) == 0 or os.environ.get("STEP_PHASES_ALL_RANKS") == "1"


def timed(owner: type, name: str, label: str | Callable[[object], str]) -> None:
    """Replace ``owner.name`` by a version that records its synchronized wall time under ``label``
    (or ``label(first argument)``: one line per object)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return original(*args, **kwargs)  # inside a CUDA-graph capture: no synchronization there
        synchronize()
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            synchronize()
            TIMES[label if isinstance(label, str) else label(args[0])].append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def profile_one_call(owner: type, name: str) -> None:
    """Run the PROFILE_CALL-th call of ``owner.name`` under torch.profiler (tables on rank 0)."""
    original: Callable = getattr(owner, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] != PROFILE_CALL:
            return original(*args, **kwargs)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            out = original(*args, **kwargs)
            synchronize()
        if rank0():
            events = prof.key_averages()
            print(
                f"PROFILE {owner.__name__}.{name} call {calls[0]} (rank {os.environ.get('RANK', '0')}): "
                f"{sum(e.count for e in events if e.key.startswith('aten::'))} aten ops",
                flush=True,
            )
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            print(events.table(sort_by=sort, row_limit=20), flush=True)
        return out

    setattr(owner, name, wrapper)


def report(title: str) -> None:
    if rank0():
        print(f"PHASES {title} (rank {os.environ.get('RANK', '0')})", flush=True)
        for label, values in TIMES.items():
            values = values[len(values) // 4 :]  # skip the first quarter (warm-up, engine build)
            if values:
                print(f"  {label:48s} median {1e3 * statistics.median(values):8.2f} ms  x{len(values)}", flush=True)
    TIMES.clear()


def engine_phases() -> None:
    profile_one_call(Dion3Engine, "step")
    timed(Dion3Engine, "step", "  engine.step")
    timed(exchange.BlockExchange, "score", "    accumulate + score (per shape group)")
    timed(general.GeneralExchange, "score", "    accumulate + score, general path (per shape group)")
    timed(static.StaticExchange, "step", "    exchange + update, static sizes (per group)")
    timed(planned.PlannedExchange, "step", "    exchange + update, row/col blocks (per group)")
    timed(general.GeneralExchange, "step", "    exchange + update, general path (per group)")


def megatron_phases() -> None:
    """Timers on Megatron's own parts of the step, which every optimizer it wraps pays, and on
    each optimizer's inner step."""
    from megatron.core.optimizer import distrib_optimizer, layer_wise_optimizer, optimizer as core_optimizer
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from dion3_megatron.megatron.optimizer import MegatronDion3

    engine_phases()
    layer_wise = layer_wise_optimizer.LayerWiseDistributedOptimizer
    timed(core_optimizer.ChainedOptimizer, "step", "Megatron optimizer.step (all of it)")
    timed(core_optimizer.ChainedOptimizer, "prepare_grads", "  grads to fp32 + inf check")
    timed(core_optimizer.ChainedOptimizer, "get_grad_norm", "  grad norm")
    timed(layer_wise, "get_grad_norm", "  grad norm (layer-wise)")
    timed(core_optimizer, "clip_grad_by_total_norm_fp32", "  clip (per chained optimizer)")
    timed(layer_wise, "step_with_ready_grads", "  layer-wise inner steps + parameter all-gather")
    timed(
        core_optimizer.Float16OptimizerWithFloat16Params,
        "step_with_ready_grads",
        "  inner step + main-to-model copy (per chained optimizer)",
    )
    timed(
        distrib_optimizer.DistributedOptimizer,
        "step_with_ready_grads",
        "  inner step + main-to-model copy + all-gather (DistributedOptimizer)",
    )
    timed(layer_wise, "start_param_sync_for_bucket_group_subset", "  parameter all-gather")
    timed(TensorParallelMuon, "step", "Muon inner step")
    timed(MegatronDion3, "step", "Dion3 inner step")
    timed(MegatronDion3, "step_check", "  step checks")
    timed(MegatronDion3, "_ensure_engine", "  refresh shards")
    timed(torch.optim.AdamW, "step", "Adam inner step (torch AdamW: no apex or Transformer Engine)")


def megatron(argv: list[str]) -> None:
    import bench_megatron as bench  # beside this script

    megatron_phases()
    run = bench.run

    def run_and_report(args, name, device, tp, fraction):
        TIMES.clear()
        try:
            return run(args, name, device, tp, fraction)
        finally:
            report(f"{name} tp={tp} f={fraction}")

    bench.run = run_and_report
    bench.main(argv)


def pretrain(argv: list[str]) -> None:
    """A Megatron-LM training script (its pretrain() path) through the launcher, phases timed."""
    from dion3_megatron.megatron import launch

    megatron_phases()
    try:
        launch.main(argv)
    finally:
        report(argv[0] if argv else "pretrain")


def deepspeed(argv: list[str]) -> None:
    from deepspeed.runtime import bf16_optimizer, engine
    from deepspeed.runtime.zero import stage_1_and_2

    from dion3_megatron.deepspeed import zero

    engine_phases()
    # DeepSpeed's own parts of engine.step() (BF16_Optimizer: bf16 with ZeRO-1), which every optimizer pays.
    profile_one_call(engine.DeepSpeedEngine, "_take_model_step")
    timed(engine.DeepSpeedEngine, "_take_model_step", "DeepSpeed engine model step (all of it)")
    timed(bf16_optimizer.BF16_Optimizer, "step", "  BF16_Optimizer.step")
    timed(bf16_optimizer, "get_global_norm_of_tensors", "    grad norm")
    timed(bf16_optimizer, "clip_tensors_by_global_norm", "    clip")
    timed(bf16_optimizer.BF16_Optimizer, "update_lp_params", "    fp32-to-bf16 copy + all-gather")
    timed(bf16_optimizer.BF16_Optimizer, "clear_hp_grads", "    clear fp32 grads")
    timed(bf16_optimizer.BF16_Optimizer, "zero_grad", "  zero_grad")
    # DeepSpeedZeroOptimizer (ZeRO-1/2, and bf16 with bf16 gradient accumulation).
    zero_opt = stage_1_and_2.DeepSpeedZeroOptimizer
    timed(engine.DeepSpeedEngine, "backward", "DeepSpeed engine backward (ZeRO's gradient reduction inside)")
    timed(zero_opt, "backward_epilogue", "  ZeRO backward epilogue")
    timed(zero_opt, "check_overflow", "  ZeRO overflow check (first collective of its step)")
    timed(zero_opt, "scaled_global_norm", "  ZeRO grad norm")
    timed(zero_opt, "_optimizer_step", "  ZeRO inner step (per param group)")
    timed(stage_1_and_2, "all_gather_dp_groups", "  ZeRO parameter all-gather")
    timed(
        zero.ZeroStep,
        "step",
        lambda plan: (
            f"ZeRO step of every partition ({len(plan.partitions)} partitions, "
            f"{sum(len(p.pieces) for p in plan.partitions)} matrices, "
            f"{sum(q.shard.sharding.kind != 'full' for p in plan.partitions for q in p.pieces)} "
            f"of them split, {sum(len(p.adamw_runs) for p in plan.partitions)} AdamW runs)"
        ),
    )
    timed(local.WholeExchange, "step_all", "  matrices one rank holds whole (all groups)")
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        report(argv[0])


def main() -> None:
    harnesses = {"megatron": megatron, "pretrain": pretrain, "deepspeed": deepspeed}
    if len(sys.argv) < 2 or sys.argv[1] not in harnesses:
        raise SystemExit("usage: step_phases.py {megatron BENCH_ARGS | pretrain SCRIPT ARGS | deepspeed SCRIPT ARGS}")
    harnesses[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
