"""Train the small byte-level GPT with PyTorch FSDP2 (``fully_shard``, as torchtitan does) and Dion3.

Each transformer block, then the whole model, is sharded by rows over the ranks; Dion3 steps every
rank's piece as a piece of the whole matrices (rows are selected over the whole matrix, so the
result equals one process's at any world size). ``--replicate R``: HSDP, R replicas of a model
sharded over world/R ranks. ``--tp T``: tensor parallelism T inside FSDP2 over world/T ranks (each
block's MLP: fc1 split by rows, fc2 by columns). CPU (gloo) by default, one GPU per rank (nccl)
when each rank has one.
Usage: torchrun --standalone --nproc-per-node 2 examples/fsdp2_train.py [--steps 100] [--fraction auto|0.25|...]
       [--replicate R | --tp T]
"""

import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dion3_megatron import Dion3
from dion3_megatron.options import BY_NAME
from example_args import ExampleParser  # examples/*.py, beside this script
from leave_process_group import leave_process_group
from small_gpt import GPT
from stdlib_text import stdlib_tokens

FRACTION = BY_NAME["fraction"]


def main() -> None:
    parser = ExampleParser(description=__doc__.splitlines()[0], other_spellings={"--dion3-fraction": "--fraction"})
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--context", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--fraction", type=FRACTION.argparse_type(), default=FRACTION.default, help=f"Dion3's f: {FRACTION.allowed()}")
    parser.add_argument("--lr", type=float, default=BY_NAME["lr"].default, help="Dion3's learning rate")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--replicate", type=int, default=1, help="HSDP: replicas of the sharded model")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks inside FSDP2")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    for name, size in (("--replicate", args.replicate), ("--tp", args.tp)):
        if size < 1 or world % size:
            parser.error(f"{name} {size} does not divide the {world} ranks")
    if args.tp > 1:
        full = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        mesh, data_rank = full["dp"], full["dp"].get_local_rank()  # a tensor-parallel group reads one batch
    elif args.replicate > 1:
        mesh = init_device_mesh(device.type, (args.replicate, world // args.replicate), mesh_dim_names=("replicate", "shard"))
        data_rank = rank
    else:
        mesh, data_rank = init_device_mesh(device.type, (world,)), rank

    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT(width=128, layers=2, heads=4, context=args.context).to(device)
    for block in model.blocks:
        if args.tp > 1:
            parallelize_module(block, full["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Hidden-layer matrices take Dion3; embeddings, the output head and 1-D params take AdamW.
    hidden = [(n, p) for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() >= 2]
    hidden_ids = {id(p) for _, p in hidden}
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in hidden_ids]
    opt = Dion3([{"params": hidden}, {"params": rest, "algorithm": "adamw", "lr": 3e-3}], lr=args.lr, fraction=args.fraction)

    data = stdlib_tokens(2_000_000).to(device)
    split = int(0.95 * len(data))
    gen = torch.Generator(device=device).manual_seed(1 + data_rank)  # each data-parallel rank its own batches

    def batch(lo: int, hi: int) -> torch.Tensor:
        starts = torch.randint(lo, hi - args.context - 1, (args.batch,), device=device, generator=gen)
        return data[starts[:, None] + torch.arange(args.context + 1, device=device)]

    if rank == 0:
        how = (
            f"tensor parallelism {args.tp} inside FSDP2 over {world // args.tp}"
            if args.tp > 1
            else f"HSDP, {args.replicate} replicas of FSDP2 over {world // args.replicate}"
            if args.replicate > 1
            else f"FSDP2 over {world}"
        )
        print(
            f"Dion3 fraction={args.fraction}, {how} ranks on {device.type}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params",
            flush=True,
        )
    start = time.time()
    for step in range(1, args.steps + 1):
        loss = model(batch(0, split))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 20 == 0 or step == 1):
            rate = step * args.batch * (world // args.tp) * args.context / (time.time() - start)
            print(f"step {step:4d}  loss {loss.item():.3f}  ({rate:,.0f} tokens/s)", flush=True)
    with torch.no_grad():
        val = torch.stack([model(batch(split, len(data))) for _ in range(5)]).mean()
    dist.all_reduce(val)
    val = val.item() / world
    if rank == 0:
        print(f"validation loss {val:.3f} ({val / math.log(2):.2f} bits/byte); skipped steps {opt.skipped_steps}")
        if args.fraction == "auto":
            chosen = sorted({(tuple(p.shape), opt.fractions[p]) for _, p in hidden})
            print("fraction=auto chose (shape: f) " + ", ".join(f"{'x'.join(map(str, s))}: {f:g}" for s, f in chosen))
    leave_process_group()


if __name__ == "__main__":
    main()
