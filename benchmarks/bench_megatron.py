"""Train a small GPT with Megatron-Core and compare optimizers: loss curve and optimizer-step time.

    torchrun --nproc-per-node 2 benchmarks/bench_megatron.py --tp 2,1 --optimizers dion3,dion3@0.125,muon,adam

Megatron-Core's own pieces as ``pretrain()`` wires them: GPTModel (local spec;
examples/small_gpt.py), DDP with the layer-wise ZeRO-1 layout (``--use-distributed-optimizer``),
``get_megatron_optimizer``, the lr scheduler, ``forward_backward_func``; bf16 with fp32 main
params. The layout is Megatron's ``wrap_model_chunks_with_ddp``: for dion3 the one
``megatron.training.pretrain()`` builds (either path; docs/megatron.md, ZeRO-1), for adam
Megatron's DistributedOptimizer; for muon the one ``pretrain()`` builds for a model-provider script
(Megatron-LM's pretrain_gpt.py, a model-config script, gives muon the legacy all-reduce path
instead). Data: a learnable synthetic language (each token mostly follows a fixed random
successor), identical for every optimizer. Prints one JSON line per optimizer (rank 0): losses
every ``--log-every`` steps and the median optimizer-step time (``optimizer.step()`` between two
CUDA synchronizations).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.small_gpt import megatron_config, megatron_gpt  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="1", help="tensor-parallel size, or a comma list run one after another (2,1)")
    p.add_argument("--optimizers", default="dion3,muon,adam", help="comma list; dion3@F runs Dion3 at fraction F (dion3@0.125)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01, help="Dion3 / Muon matrices (and Megatron's Adam on norms)")
    p.add_argument("--adam-lr", type=float, default=1e-3, help="adam run; embeddings/output in every run")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--muon-lr", type=float, default=None, help="Megatron Muon's matrix lr (default: --lr)")
    p.add_argument(
        "--muon-scale-mode",
        default="unit_rms_norm",
        help="Megatron Muon's update scale: unit_rms_norm = sqrt(rows/cols), the scale Dion3's default "
        "adjust_lr (spectral_norm) applies, so one --lr fits both; Megatron's own default, "
        "spectral = sqrt(max(rows, cols)), expects an AdamW-sized lr (~1e-3)",
    )
    p.add_argument("--muon-tp-mode", default="blockwise", help="Megatron Muon's TP mode (Megatron's default)")
    p.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="Megatron's --overlap-grad-reduce --overlap-param-gather: the parameter all-gather "
        "leaves optimizer.step() for the next forward pass, as in production runs",
    )
    p.add_argument("--json", help="append one JSON line per run here (rank 0)")
    p.add_argument("--cpu", action="store_true", help="gloo + examples/megatron_cpu.py (smoke test only)")
    return p.parse_args(argv)


def synthetic_batch(gen, batch, seq, vocab, successor, device):
    """Tokens whose successor is successor[token] with prob 0.75, else uniform: entropy ~1.4 nats + ..."""
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    noise = torch.randint(0, vocab, (batch, seq), generator=gen)
    keep = torch.rand(batch, seq, generator=gen) < 0.75
    for i in range(seq):
        tokens[:, i + 1] = torch.where(keep[:, i], successor[tokens[:, i]], noise[:, i])
    return tokens.to(device)


def run(args, name, device, tp, fraction):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.training import wrap_model_chunks_with_ddp

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = megatron_config(
        layers=args.layers, hidden=args.hidden, heads=args.heads, query_groups=args.heads // 4, ffn=args.ffn, tp=tp, dtype=torch.bfloat16
    )
    model = megatron_gpt(config, args.vocab, args.seq)
    model.to(device)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_param_gather,
        overlap_param_gather=args.overlap_param_gather,
    )
    layer_wise = name != "adam"
    chunks = wrap_model_chunks_with_ddp([model], config, ddp_config, use_layer_wise_distributed_optimizer=layer_wise)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = chunks[0].no_sync
    lr = args.adam_lr if name == "adam" else args.lr
    if name == "muon" and args.muon_lr is not None:
        lr = args.muon_lr
    ocfg = OptimizerConfig(
        optimizer=name,
        lr=lr,
        min_lr=lr / 10,
        weight_decay=0.01,
        bf16=True,
        clip_grad=1.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        use_distributed_optimizer=True,
        use_layer_wise_distributed_optimizer=layer_wise,
        overlap_param_gather=args.overlap_param_gather,
        decoupled_lr=None if name == "adam" else args.adam_lr,
        decoupled_min_lr=args.adam_lr / 10,
    )
    if name == "dion3":
        ocfg.dion3_fraction = fraction
    if name == "muon":
        ocfg.muon_scale_mode = args.muon_scale_mode
        ocfg.muon_tp_mode = args.muon_tp_mode
    opt = get_megatron_optimizer(ocfg, chunks)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=lr,
        min_lr=lr / 10,
        lr_warmup_steps=args.steps // 10,
        lr_decay_steps=args.steps,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=args.steps,
        wd_incr_style="constant",
    )
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(42)
    successor = torch.randperm(args.vocab, generator=gen)
    fwd_bwd = get_forward_backward_func()

    def forward_step(data_iterator, m):
        b = next(data_iterator)
        tokens, labels = b[:, :-1], b[:, 1:]
        pos = torch.arange(args.seq, device=device).unsqueeze(0).expand_as(tokens)
        out = m(tokens, pos, None, labels=labels)
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    losses, step_times, total = [], [], []
    for step in range(args.steps):
        batch = synthetic_batch(gen, args.micro_batch * dp, args.seq, args.vocab, successor, device)
        local = batch.chunk(dp)[dp_rank]
        t0 = time.perf_counter()
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        out = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=iter([local]),
            model=chunks,
            num_microbatches=1,
            seq_length=args.seq,
            micro_batch_size=args.micro_batch,
            forward_only=False,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        sched.step(1)
        if step >= min(5, args.steps // 2):
            step_times.append(t2 - t1)
            total.append(t2 - t0)
        if step % args.log_every == 0 or step == args.steps - 1:
            loss = out[0]["loss"].clone() if out else torch.zeros((), device=device)
            dist.all_reduce(loss)
            losses.append((step, round(loss.item() / dist.get_world_size(), 4)))
    params = sum(p.numel() for p in model.parameters())
    dist.all_reduce(t := torch.tensor(float(params), device=device))  # sum of TP shards (norms counted tp times)
    result = dict(
        optimizer=name,
        tp=tp,
        dp=dp,
        overlap_param_gather=args.overlap_param_gather,
        layers=args.layers,
        hidden=args.hidden,
        steps=args.steps,
        lr=lr,
        params=int(t.item()) // dp,
        losses=losses,
        opt_step_ms=round(1e3 * statistics.median(step_times), 2) if step_times else None,
        train_step_ms=round(1e3 * statistics.median(total), 2) if total else None,
    )
    if len(step_times) >= 4:
        q = statistics.quantiles(step_times, n=4)
        result["opt_step_ms_q1_q3"] = [round(1e3 * q[0], 2), round(1e3 * q[2], 2)]
    if name == "dion3":
        result["fraction"] = fraction
    if name == "muon":
        result.update(muon_scale_mode=args.muon_scale_mode, muon_tp_mode=args.muon_tp_mode)
    del opt, chunks, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None):
    args = parse(argv)
    if args.cpu:
        from examples.megatron_cpu import install

        install()
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    from dion3_megatron.megatron import register

    register()
    for tp in (int(t) for t in str(args.tp).split(",")):
        for spec in args.optimizers.split(","):
            name, _, frac = spec.partition("@")
            fraction = float(frac) if frac else args.fraction
            try:
                result = run(args, name, device, tp, fraction)
            except Exception as e:  # noqa: BLE001 - report and go on with the next optimizer
                result = dict(optimizer=spec, tp=tp, error=f"{type(e).__name__}: {e}"[:500])
                import traceback

                traceback.print_exc()
            if dist.get_rank() == 0:
                print("BENCH " + json.dumps(result), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
