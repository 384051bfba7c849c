"""Train a small byte-level GPT with DeepSpeed; the optimizer comes from the JSON config.

    deepspeed --num_gpus 2 examples/deepspeed/train_gpt.py --config examples/deepspeed/ds_config_dion3.json
    # CPU: DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 examples/deepspeed/train_gpt.py \
    #        --config examples/deepspeed/ds_config_dion3.json --cpu --width 64 --layers 2 --seq 64 --steps 20

The model is ``examples/small_gpt.py``'s GPT. The only Dion3-specific line is
``import dion3_megatron.deepspeed`` (it registers
``"type": "Dion3"``); ``param_groups`` puts embeddings, the output head, norms and biases on
AdamW, as DeepSpeed's Muon does. The corpus is the running Python's standard-library sources.
Prints the loss, the iteration time, the forward and backward times (the backward holds ZeRO's
gradient reduction, where DeepSpeed's Muon orthogonalizes), the time of ``engine.step()`` (at a
gradient-accumulation boundary: gradient norm, clipping, the optimizer step, the ZeRO all-gather)
and the time spent in the optimizer's own ``step()``; ``--json`` writes them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

import deepspeed

import dion3_megatron.deepspeed as dion3_deepspeed  # registers "type": "Dion3"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/: the shared modules
from deepspeed_setup import quiet_deprecated_collectives, skip_shared_memory_op  # noqa: E402
from example_args import ExampleParser  # noqa: E402
from leave_process_group import leave_process_group  # noqa: E402
from small_gpt import GPT  # noqa: E402
from step_timer import StepTimer  # noqa: E402
from stdlib_text import stdlib_tokens  # noqa: E402


def main() -> None:
    parser = ExampleParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="DeepSpeed's JSON config (its optimizer is the one trained)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--width", type=int, default=512, help="hidden size")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers")
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights' initialization")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes even where CUDA is available (without CUDA: always)")
    parser.add_argument("--json", help="write losses and timings here (rank 0)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()

    cpu = args.cpu or not torch.cuda.is_available()
    skip_shared_memory_op()
    quiet_deprecated_collectives()
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)

    with open(args.config) as f:
        config = json.load(f)
    torch.manual_seed(args.seed)
    model = GPT(args.width, args.layers, args.heads, args.seq)
    name = config["optimizer"]["type"]
    params = dion3_deepspeed.param_groups(model) if name == "Dion3" else model.parameters()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    optimizer_step = StepTimer(sync)  # the inner optimizer's own step(), summed over one engine step
    optimizer_step.wrap(engine.basic_optimizer)
    inner_times: list[float] = []
    corpus = stdlib_tokens(8_000_000)
    micro = engine.train_micro_batch_size_per_gpu()
    ga = engine.gradient_accumulation_steps()
    gen = torch.Generator().manual_seed(1234)
    losses, iter_times, step_times, fwd_times, bwd_times = [], [], [], [], []
    for step in range(args.steps):
        sync()
        t0 = time.perf_counter()
        total, fwd, bwd = 0.0, 0.0, 0.0
        for _ in range(ga):
            starts = torch.randint(0, corpus.numel() - args.seq - 1, (world, micro), generator=gen)[rank]
            tokens = torch.stack([corpus[s : s + args.seq] for s in starts.tolist()]).to(device)
            sync()
            ta = time.perf_counter()
            loss = engine(tokens)
            sync()
            tb = time.perf_counter()
            engine.backward(loss)  # ZeRO's gradient reduction (and DeepSpeed Muon's orthogonalization) runs here
            sync()
            t1 = time.perf_counter()
            fwd, bwd = fwd + tb - ta, bwd + t1 - tb
            engine.step()
            total += float(loss.detach()) / ga
        sync()
        step_times.append(time.perf_counter() - t1)
        fwd_times.append(fwd)
        bwd_times.append(bwd)
        inner_times.append(optimizer_step.take())
        iter_times.append(time.perf_counter() - t0)
        loss_t = torch.tensor(total, device=device)
        torch.distributed.all_reduce(loss_t)
        losses.append(loss_t.item() / world)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(
                f"step {step:4d}  loss {losses[-1]:.4f}  iter {iter_times[-1] * 1e3:.1f} ms  "
                f"fwd {fwd_times[-1] * 1e3:.1f} ms  bwd {bwd_times[-1] * 1e3:.1f} ms  "
                f"engine.step {step_times[-1] * 1e3:.1f} ms  optimizer.step {inner_times[-1] * 1e3:.1f} ms",
                flush=True,
            )

    warm = slice(min(5, args.steps - 1), None)
    summary = {
        "optimizer": name,
        "world": world,
        "config": config,
        "model": {
            "width": args.width,
            "layers": args.layers,
            "heads": args.heads,
            "seq": args.seq,
            "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        },  # (ZeRO-3: whole)
        "losses": losses,
        "final_loss_mean_last10": statistics.mean(losses[-10:]),
        "median_iter_ms": statistics.median(iter_times[warm]) * 1e3,
        "median_engine_step_ms": statistics.median(step_times[warm]) * 1e3,
        "median_forward_ms": statistics.median(fwd_times[warm]) * 1e3,
        "median_backward_ms": statistics.median(bwd_times[warm]) * 1e3,
        "median_inner_optimizer_step_ms": statistics.median(inner_times[warm]) * 1e3,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k not in ("losses", "config")}))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    leave_process_group()


if __name__ == "__main__":
    main()
