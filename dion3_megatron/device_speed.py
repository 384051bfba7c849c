"""``fraction="auto"``: the measured device speed, and :func:`resolve_fractions`, which every
front end asks for its matrices' f (the cost model itself is :func:`rule.auto_fraction`).

Three short timings per (device, dtype), once per process: a large matmul (FLOP/s), a tiny one
(the fixed cost of a kernel, host overhead included) and a copy (memory bandwidth). The link
bandwidth is assumed per backend, not measured. Ranks that step matrices together must choose
the same f, so :func:`for_group` gives them all the slowest member's numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .ortho import default_ns_dtype
from .rule import DeviceSpeed, Dion3Hyperparameters, auto_fraction

# Per-rank all-to-all bandwidth assumed for a backend (bytes/s): NVLink-class for NCCL, a
# loopback/ethernet-class figure for gloo.
LINK_BYTES_PER_S = {"nccl": 100e9, "gloo": 1e9}

_measured: dict[tuple, DeviceSpeed] = {}


def _seconds_per_call(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps


@torch.no_grad()
def measure(device: torch.device, dtype: torch.dtype) -> DeviceSpeed:
    """Time this device once (tens of ms on a GPU, ~0.1 s on a CPU); later calls hit a cache."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _measured:
        cuda = device.type == "cuda"
        gen = torch.Generator(device=device).manual_seed(0)
        n = 2048 if cuda else 256
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        flops = 2 * n**3 / _seconds_per_call(lambda: a @ a, device, 10 if cuda else 3)
        tiny = a[:16, :16].contiguous()
        launch = _seconds_per_call(lambda: tiny @ tiny, device, 50)
        src = torch.randn((1 << 24) if cuda else (1 << 21), device=device, generator=gen)
        dst = torch.empty_like(src)
        memory = 2 * src.numel() * src.element_size() / _seconds_per_call(lambda: dst.copy_(src), device, 10)
        link = LINK_BYTES_PER_S["nccl" if cuda else "gloo"]
        _measured[key] = DeviceSpeed(flops, launch, memory, link)
    return _measured[key]


def for_group(device: torch.device, dtype: torch.dtype, group: Optional[dist.ProcessGroup]) -> DeviceSpeed:
    """This device's speed with the link of ``group``'s backend, agreed over the group's members (a
    collective when the group has more than one rank) so that all of them choose the same f: the
    slowest member's numbers, since a step that needs all of them waits for it."""
    speed = measure(device, dtype)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return speed
    link = LINK_BYTES_PER_S.get(str(dist.get_backend(group)), LINK_BYTES_PER_S["gloo"])
    values = torch.tensor([speed.matmul_flops, -speed.launch_seconds, speed.memory_bytes_per_s, link],
                          dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    flops, neg_launch, memory, link = values.tolist()
    return DeviceSpeed(flops, -neg_launch, memory, link)


@dataclass(frozen=True)
class FractionRequest:
    """A batch of same-shape matrices whose f ``fraction="auto"`` chooses."""

    shape: tuple[int, int]
    batch: int  # matrices orthogonalized together (megabatching shares the launch cost)
    world: int  # ranks the batch's exchange spans (1: stepped where it lies)
    hp: Dion3Hyperparameters  # its ns_method, ns_dtype and num_heads
    device: torch.device
    group: Optional[dist.ProcessGroup] = None  # whose members agree on the speed (None: this rank alone)


def _speed_key(device: torch.device, hp: Dion3Hyperparameters, group: Optional[dist.ProcessGroup]) -> tuple:
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None and dist.is_initialized() else ()
    return ranks, str(device), hp.ns_dtype or default_ns_dtype(device)


def resolve_fractions(
    requests: Sequence[FractionRequest],
    joined: Sequence[tuple[torch.device, Dion3Hyperparameters, dist.ProcessGroup]] = (),
) -> list[float]:
    """The f of each request: :func:`rule.auto_fraction` on the speed its group agrees on.

    One collective per (group, device, dtype), in the order of the groups' ranks, so that every
    member makes the same calls: a rank must call with the same groups as its peers, and names in
    ``joined`` (device, settings, group) those it agrees on without a request of its own.
    """
    wanted = {_speed_key(r.device, r.hp, r.group): (r.device, r.hp, r.group) for r in requests}
    for device, hp, group in joined:
        wanted.setdefault(_speed_key(device, hp, group), (device, hp, group))
    speeds = {key: for_group(device, key[2], group)
              for key, (device, hp, group) in sorted(wanted.items(), key=lambda item: item[0][0])}
    return [auto_fraction(*r.shape, speeds[_speed_key(r.device, r.hp, r.group)], r.world, r.batch,
                          r.hp.ns_method, r.hp.num_heads) for r in requests]
