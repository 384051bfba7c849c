"""The automatic fraction on the devices: the speeds the cost model (:mod:`dion3_megatron.core.cost_model`)
takes, measured once per (device, dtype) and process, and agreed across the ranks that must choose
the same f (:func:`for_group`, :func:`agree_per_dtype`), and :func:`choose_fractions`, which the
plan asks for its groups' f (the torch class's ranks agree the speeds once, :class:`AgreedSpeeds`).

Three short timings per (device, dtype): a large matmul (FLOP/s), a tiny one (the fixed cost of a
kernel, host overhead included) and a copy (memory bandwidth). The link bandwidth is assumed per
backend, not measured. Ranks that step matrices together get the slowest member's numbers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..core import cost_model
from ..core.cost_model import DeviceSpeed
from ..core.ortho import NS_DTYPES, default_ns_dtype
from ..core.rule import Dion3Hyperparameters


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


def _link_of(group: dist.ProcessGroup) -> float:
    """The all-to-all bandwidth assumed for ``group``'s backend (gloo's for an unknown one)."""
    return LINK_BYTES_PER_S.get(str(dist.get_backend(group)), LINK_BYTES_PER_S["gloo"])


def for_group(
    device: torch.device, dtype: torch.dtype, group: Optional[dist.ProcessGroup], step_share: float = 1.0
) -> tuple[DeviceSpeed, float]:
    """This device's speed with the link of ``group``'s backend, and ``step_share``, agreed over the
    group's members (a collective when the group has more than one rank) so that all of them choose
    the same f: the slowest member's numbers, since a step that needs all of them waits for it, and
    the largest share (the member whose step weighs most in its iteration)."""
    speed = measure(device, dtype)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return speed, step_share
    link = _link_of(group)
    values = torch.tensor(
        [speed.matmul_flops, -speed.launch_seconds, speed.memory_bytes_per_s, link, -step_share], dtype=torch.float64, device=device
    )
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    flops, neg_launch, memory, link, neg_share = values.tolist()
    return DeviceSpeed(flops, -neg_launch, memory, link), -neg_share


def slowest(a: DeviceSpeed, b: DeviceSpeed) -> DeviceSpeed:
    """Each number of the two speeds at its slower value."""
    return DeviceSpeed(
        min(a.matmul_flops, b.matmul_flops),
        max(a.launch_seconds, b.launch_seconds),
        min(a.memory_bytes_per_s, b.memory_bytes_per_s),
        min(a.link_bytes_per_s, b.link_bytes_per_s),
    )


def agree_per_dtype(
    local: Sequence[tuple[torch.device, torch.dtype]], group: Optional[dist.ProcessGroup]
) -> dict[torch.dtype, DeviceSpeed]:
    """The speed of every Newton-Schulz dtype that a member of ``group`` steps, agreed in ONE
    collective whatever this rank holds (no dtype, one, or several on several devices), so that
    every member makes the same call: each dtype at its slowest member's numbers (only the members
    that step it count), with the link of the group's backend. local: the (device, dtype) pairs
    this rank steps. Without a group of more than one rank: this rank's own measurements."""
    mine: dict[torch.dtype, DeviceSpeed] = {}
    for device, dtype in local:
        speed = measure(device, dtype)
        mine[dtype] = slowest(mine[dtype], speed) if dtype in mine else speed
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return mine
    link = _link_of(group)
    order = list(NS_DTYPES.values())
    values = torch.full((len(order), 3), math.inf, dtype=torch.float64)  # +inf: this rank has no say
    for i, dtype in enumerate(order):
        if dtype in mine:
            speed = mine[dtype]
            values[i] = torch.tensor([speed.matmul_flops, -speed.launch_seconds, speed.memory_bytes_per_s])
    if str(dist.get_backend(group)) == "nccl":
        values = values.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    return {
        dtype: DeviceSpeed(flops, -neg_launch, memory, link)
        for dtype, (flops, neg_launch, memory) in zip(order, values.tolist())
        if flops != math.inf
    }


@dataclass
class AgreedSpeeds:
    """The speed of each Newton-Schulz dtype that ranks stepping whole matrices alike (data-parallel
    replicas) agreed once, at their first step (:func:`agree_per_dtype`), so that later choices (a
    matrix that first gets a gradient later, a param group added) make no collective. A dtype that
    none of them stepped then is measured here where this rank is alone, and refused where it is not."""

    by_dtype: dict[torch.dtype, DeviceSpeed]
    distributed: bool
    members: frozenset[int] = frozenset()  # the ranks that agreed (distributed only)

    def covers(self, group: Optional[dist.ProcessGroup]) -> bool:
        """Whether every rank of ``group`` (None: this rank alone) took part in the agreement."""
        return group is None or set(dist.get_process_group_ranks(group)) <= self.members

    def of(self, device: torch.device, dtype: torch.dtype) -> DeviceSpeed:
        if dtype not in self.by_dtype:
            if self.distributed:
                raise ValueError(
                    f"fraction='auto' with ns_dtype={dtype}: no rank stepped a group of that dtype at the "
                    "first step, when the ranks agreed on the device's speed; give such groups from the "
                    "start, or set their fraction"
                )
            self.by_dtype[dtype] = measure(device, dtype)
        return self.by_dtype[dtype]


def agreed_speeds(local: Sequence[tuple[torch.device, torch.dtype]], group: Optional[dist.ProcessGroup] = None) -> AgreedSpeeds:
    """The speeds of the Newton-Schulz dtypes this rank's whole matrices choose their automatic f
    by (``local``: (device, dtype) pairs), agreed over ``group`` (default: the world) in one
    collective under torch.distributed (:func:`agree_per_dtype`): every member makes the call,
    whatever it holds, and replicas of a matrix choose the same f."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed:
        return AgreedSpeeds(agree_per_dtype(list(set(local)), None), False)
    group = group or dist.group.WORLD
    return AgreedSpeeds(agree_per_dtype(list(set(local)), group), True, frozenset(dist.get_process_group_ranks(group)))


@dataclass(frozen=True)
class FractionRequest:
    """A batch of same-shape matrices whose automatic f is chosen."""

    shape: tuple[int, int]
    batch: int  # matrices orthogonalized together (megabatching shares the launch cost)
    world: int  # ranks the batch's exchange spans (1: stepped where it lies)
    hp: Dion3Hyperparameters  # its ns_method, ns_dtype and num_heads
    device: torch.device
    group: Optional[dist.ProcessGroup] = None  # whose members agree on the speed (None: this rank alone)
    step_share: float = 1.0  # see modelled_loss_change
    speeds: Optional[AgreedSpeeds] = None  # speeds agreed before: no collective (group unused)


def _speed_key(device: torch.device, hp: Dion3Hyperparameters, group: Optional[dist.ProcessGroup]) -> tuple:
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None and dist.is_initialized() else ()
    return ranks, str(device), hp.ns_dtype or default_ns_dtype(device)


def choose_fractions(
    requests: Sequence[FractionRequest],
    joined: Sequence[tuple[torch.device, Dion3Hyperparameters, dist.ProcessGroup]] = (),
) -> list[float]:
    """The f of each request: :func:`choose_fraction` on the speed and step share its group agrees on
    (or on the speeds it brings, :class:`AgreedSpeeds`).

    One collective per (group, device, dtype), in the order of the groups' ranks, so that every
    member makes the same calls: a rank must call with the same groups as its peers, and names in
    ``joined`` (device, settings, group) those it agrees on without a request of its own.
    """
    agreed: dict[tuple, tuple[DeviceSpeed, float]] = {}
    wanted: dict[tuple, tuple] = {}
    for r in requests:  # a group's requests share its largest step share
        if r.speeds is not None:
            continue
        key = _speed_key(r.device, r.hp, r.group)
        share = max(r.step_share, wanted[key][2]) if key in wanted else r.step_share
        wanted[key] = (r.device, r.group, share)
    for device, hp, group in joined:
        wanted.setdefault(_speed_key(device, hp, group), (device, group, 0.0))  # no share of its own
    for key, (device, group, share) in sorted(wanted.items(), key=lambda item: item[0][0]):
        if key not in agreed:
            agreed[key] = for_group(device, key[2], group, share)
    out = []
    for r in requests:
        if r.speeds is not None:
            speed, share = r.speeds.of(r.device, r.hp.ns_dtype or default_ns_dtype(r.device)), r.step_share
        else:
            speed, share = agreed[_speed_key(r.device, r.hp, r.group)]
        out.append(cost_model.choose_fraction(*r.shape, speed, r.world, r.batch, r.hp.ns_method, r.hp.num_heads, share))
    return out
