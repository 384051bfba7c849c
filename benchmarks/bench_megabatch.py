"""Megabatched Dion3 vs one-matrix-at-a-time Muon on a tensor-parallel GPT layer set.

Each rank holds its TP shard of every matrix of a GPT (Q, K, V and fc1 split on rows; the
attention projection and fc2 on columns). Compared, side by side in one run:
  - dion3 f: the megabatch engine (3 collectives per distinct shape, selected rows only);
  - muon-duplicated: Megatron Muon's "duplicated" mode: per matrix, all-gather the momentum,
    orthogonalize the whole matrix on every TP rank (Keller quintic NS5 in bf16), keep the slice.
Prints step time (median), the ratio, collectives per step, and collectives at two depths.

  torchrun --standalone --nproc-per-node 2 benchmarks/bench_megabatch.py            # GPUs: NCCL
  torchrun --standalone --nproc-per-node 2 benchmarks/bench_megabatch.py --hidden 256 --ffn 1024 --layers 4  # CPU: gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from dion3_megatron import kernels, options
from dion3_megatron.core import ortho
from dion3_megatron.engine import Dion3Engine, MatrixShard, Sharding


class CollectiveCounter:
    """Counts calls of the torch.distributed collectives while active."""

    NAMES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather", "broadcast")

    def __init__(self) -> None:
        self.count = 0
        self._originals = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self) -> "CollectiveCounter":
        for name, original in self._originals.items():

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def layer_matrices(hidden: int, ffn: int) -> list[tuple[str, tuple[int, int], str]]:
    return [
        ("q", (hidden, hidden), "rows"),
        ("k", (hidden, hidden), "rows"),
        ("v", (hidden, hidden), "rows"),
        ("proj", (hidden, hidden), "cols"),
        ("fc1", (ffn, hidden), "rows"),
        ("fc2", (hidden, ffn), "cols"),
    ]


def make_shards(layers, hidden, ffn, world, rank, group, device, hp, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed + rank)
    shards = []
    for i in range(layers):
        for name, (n, m), kind in layer_matrices(hidden, ffn):
            sharding = Sharding.even_rows(n, world) if kind == "rows" else Sharding.even_cols(m, world)
            local = sharding.local_shape(rank, n, m)
            weight = torch.randn(local, generator=gen, device=device) * 0.02
            grad = torch.randn(local, generator=gen, device=device)
            shards.append(MatrixShard(f"layer{i}.{name}", weight, grad, (n, m), sharding, group, hp))
    return shards


class DuplicatedMuon:
    """Per matrix: momentum, all-gather, NS5 (Keller quintic, bf16) on the full matrix, local slice."""

    def __init__(self, shards, world, lr=0.02, mu=0.95):
        self.shards, self.world, self.lr, self.mu = shards, world, lr, mu
        self.momenta = [torch.zeros_like(s.weight) for s in shards]
        self.coefficients = ortho.keller_coefficients()

    def step(self) -> None:
        for shard, momentum in zip(self.shards, self.momenta):
            momentum.mul_(self.mu).add_(shard.grad)
            n, m = shard.shape
            kind = shard.sharding.kind
            # Gather along dim 0 in memory; column shards are gathered transposed.
            local = momentum if kind == "rows" else momentum.t().contiguous()
            full = torch.empty((local.shape[0] * self.world, local.shape[1]), dtype=local.dtype, device=local.device)
            if self.world > 1:
                dist.all_gather_into_tensor(full, local, group=shard.group)
            else:
                full.copy_(local)
            full = full if kind == "rows" else full.t()
            update = ortho.newton_schulz(full, self.coefficients, dtype=torch.bfloat16, norm_factor=1.0)
            rank = dist.get_rank(shard.group) if self.world > 1 else 0
            lo, hi = shard.sharding.bounds[rank], shard.sharding.bounds[rank + 1]
            piece = update[lo:hi] if kind == "rows" else update[:, lo:hi]
            shard.weight.add_(piece.to(shard.weight.dtype), alpha=-self.lr * max(1.0, n / m) ** 0.5)


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, device, warmup, iters) -> list[float]:
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            dist.barrier()
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    # Every rank waits for the slowest: report the max over ranks of each rank's median.
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def profile_step(args, world, rank, group, device) -> None:
    """Where one engine step spends its time: host ops and device kernels, rank 0's view."""
    hp = options.hyperparameters(fraction=args.profile)
    engine = Dion3Engine(make_shards(args.layers, args.hidden, args.ffn, world, rank, group, device, hp))
    for _ in range(3):
        engine.step()
    synchronize(device)
    dist.barrier()  # profile from a common start: otherwise collectives time the other rank's lag
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        engine.step()
        synchronize(device)
    if rank == 0:
        events = prof.key_averages()
        print(f"aten ops per step: {sum(e.count for e in events if e.key.startswith('aten::'))}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=15))
        if device.type == "cuda":
            print(events.table(sort_by="self_device_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--fractions", default="1,0.25,0.125")
    parser.add_argument("--depths", default="2,24", help="layer counts for the rounds-vs-depth check")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    parser.add_argument(
        "--profile",
        type=float,
        default=None,
        metavar="F",
        help="only profile one Dion3 step at fraction F (torch.profiler tables on rank 0)",
    )
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    group = dist.new_group(list(range(world)))
    results = {
        "world": world,
        "layers": args.layers,
        "hidden": args.hidden,
        "ffn": args.ffn,
        "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
        "torch": torch.__version__,
    }
    params = args.layers * sum(n * m for _, (n, m), _ in layer_matrices(args.hidden, args.ffn))
    results["matrix_params"] = params

    if args.profile is not None:
        profile_step(args, world, rank, group, device)
        dist.destroy_process_group()
        return

    muon_shards = make_shards(args.layers, args.hidden, args.ffn, world, rank, group, device, options.hyperparameters())
    muon = DuplicatedMuon(muon_shards, world)
    with CollectiveCounter() as counter:
        muon.step()
    results["muon_collectives"] = counter.count
    with kernels.using(kernels="torch"):  # Muon as it ships: plain torch matmuls, not our kernels
        results["muon_ms"] = time_steps(muon.step, device, args.warmup, args.iters)
    del muon, muon_shards

    results["dion3"] = {}
    for fraction in [float(f) for f in args.fractions.split(",")]:
        hp = options.hyperparameters(fraction=fraction)
        shards = make_shards(args.layers, args.hidden, args.ffn, world, rank, group, device, hp)
        engine = Dion3Engine(shards)
        with CollectiveCounter() as counter:
            engine.step()
        ms = time_steps(engine.step, device, args.warmup, args.iters)
        results["dion3"][fraction] = {"ms": ms, "collectives": counter.count, "speedup_vs_muon": results["muon_ms"] / ms}
        del engine, shards

    results["collectives_by_depth"] = {}
    for depth in [int(d) for d in args.depths.split(",")]:
        hp = options.hyperparameters(fraction=0.25)
        engine = Dion3Engine(make_shards(depth, args.hidden, args.ffn, world, rank, group, device, hp))
        with CollectiveCounter() as counter:
            engine.step()
        results["collectives_by_depth"][depth] = {"dion3": counter.count, "muon": depth * len(layer_matrices(1, 1))}
        del engine

    if rank == 0:
        print(
            f"\n{results['device']} x{world}, torch {results['torch']}, TP={world}: {args.layers} layers, hidden "
            f"{args.hidden}, ffn {args.ffn} ({params / 1e9:.2f}B matrix params)"
        )
        print(f"{'optimizer':<22}{'step ms':>10}{'vs muon':>10}{'collectives':>13}")
        print(f"{'muon (duplicated)':<22}{results['muon_ms']:>10.2f}{1.0:>10.2f}{results['muon_collectives']:>13}")
        for fraction, r in results["dion3"].items():
            print(f"{'dion3 f=' + str(fraction):<22}{r['ms']:>10.2f}{r['speedup_vs_muon']:>10.2f}{r['collectives']:>13}")
        for depth, c in results["collectives_by_depth"].items():
            print(f"depth {depth:>3}: dion3 {c['dion3']} collectives per step, muon {c['muon']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
