"""``fraction="auto"``: f per matrix by the loss it costs against the time it saves
(:func:`choose_fraction`), the time from a cost model of its step on the device's measured speed,
and :func:`resolve_fractions`, which the Megatron and ZeRO front ends ask for their matrices' f
(the torch class agrees the speeds itself, :func:`agree_per_dtype`).

Three short timings per (device, dtype), once per process: a large matmul (FLOP/s), a tiny one
(the fixed cost of a kernel, host overhead included) and a copy (memory bandwidth). The link
bandwidth is assumed per backend, not measured. Ranks that step matrices together must choose
the same f, so :func:`for_group` and :func:`agree_per_dtype` give them all the slowest member's
numbers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .options import NS_DTYPES
from .ortho import default_ns_dtype, ns_flops
from .rule import Dion3Hyperparameters, selected_row_count

# --------------------------------------------------------------------------------------------
# The cost model: f per matrix from its shape, the world size and the device's speed.

AUTO_FRACTIONS = (1.0, 0.5, 0.25, 0.125)
AUTO_MIN_ROWS = 128  # quality floor: fewer selected rows than this lost to f = 1 in our runs
# The exchange rate between loss and time, from the convergence protocol
# (benchmarks/results/measurement-log.md, byte-level GPTs at 10 tokens per parameter, every family at
# its best lr):
# at equal tokens f costs about AUTO_LOSS_PER_WAITING_ROW_SHARE * (1/f - 1) nats of final validation
# loss against f = 1, each at its default mu (10.8M: f = 1 0.6954, f = 1/4 0.7088, f = 1/8 0.7210, two
# seeds each: 0.0045 and 0.0037 per unit; 48.7M: f = 1 0.5550, f = 1/4 0.5653, f = 1/8 0.5725, two
# seeds each: 0.0034 and 0.0025; the largest is taken);
AUTO_LOSS_PER_WAITING_ROW_SHARE = 0.0045
# and near the end of those runs the loss falls by 0.06-0.12 per unit of log(steps) (Muon's
# curves), so a step x times shorter buys about AUTO_LOSS_PER_LOG_TIME * ln(x) at equal wall-clock
# time (the low end taken).
AUTO_LOSS_PER_LOG_TIME = 0.06
# The optimizer cannot see the model's forward and backward, which dilute what its step saves: they
# are modelled as 6 FLOPs per parameter and token at the measured matmul rate, with this many tokens
# per data-parallel rank and step (e.g. 8 sequences of 4096), for the whole matrix on every rank.
AUTO_TOKENS_PER_STEP = 32768
NS_KERNELS = {"gram": 30, "standard": 20}  # kernels per orthogonalization call, shared by its batch
PER_MATRIX_KERNELS = 20  # kernels per matrix whatever f is: scores, top-k, gathers, NorMuon, update
# Element-wise traffic of the step per matrix entry, over n_rows + k rows. Counted from the kernels
# the step runs (fp32 momentum, gradient and weight): every entry 20 bytes (M += G
# with the row scores: 12; the weight update pass: 8), every selected entry 26 (the rows taken out and
# decayed: 12; Newton-Schulz's input scaled to half precision: 10; NorMuon's and the update's reads of
# the result: 4), 22 at f = 1 (decayed in place: 8). That is 42-48 n c at f = 1 and 26.5-30 n c at
# 1/4. With the counted figures in place of 24, choose_fraction picks the same f for the 14B and 350M
# shapes, 2048^2, 8192^2 and 4096x16384 both ways, at 1 rank (batches of 1 and 8) and 8 (64), with an
# H200's speeds assumed (650 TFLOP/s, 8 us a launch, 3.8 TB/s): 24 stays, the simpler form.
BYTES_PER_ENTRY = 24
WIRE_BYTES_PER_ENTRY = 8  # fp32 there and back through the two all-to-alls


@dataclass(frozen=True)
class DeviceSpeed:
    """What the cost model needs to know about the device (:func:`measure` times it)."""

    matmul_flops: float  # FLOP/s of a large matmul in the orthogonalization dtype
    launch_seconds: float  # time of one small kernel, host overhead included
    memory_bytes_per_s: float
    link_bytes_per_s: float  # per-rank all-to-all bandwidth of the process group's backend


def estimated_step_seconds(
    n_rows: int, n_cols: int, fraction: float, speed: DeviceSpeed,
    world: int = 1, batch: int = 1, ns_method: str = "gram", num_heads: Optional[int] = None,
) -> float:
    """Modelled time of one Dion3 step of one matrix, per rank.

    ``batch`` same-shape matrices share one orthogonalization call (megabatching), so its launch
    cost is split between them; each matrix also launches PER_MATRIX_KERNELS small kernels that
    do not shrink with f (on GPUs this fixed part dominates small matrices: measured, the step of
    a 100M model took the same time at f = 1/2, 1/4 and 1/8). With ``world`` ranks each
    orthogonalizes 1/world of the matrices and the selected rows cross the link both ways. Every
    term is per matrix and divided by ``world`` alike, so only the link term's (world - 1) / world
    depends on the world size.
    """
    k = selected_row_count(n_rows, fraction, num_heads)
    method = ns_method if k != n_cols else "standard"
    per_call = math.ceil(batch / world)
    ortho = ns_flops(k, n_cols, method) / speed.matmul_flops + NS_KERNELS[method] * speed.launch_seconds / per_call
    fixed = PER_MATRIX_KERNELS * speed.launch_seconds
    elementwise = BYTES_PER_ENTRY * (n_rows + k) * n_cols / speed.memory_bytes_per_s
    wire = WIRE_BYTES_PER_ENTRY * k * n_cols * (world - 1) / world / speed.link_bytes_per_s if world > 1 else 0.0
    return (ortho + fixed + elementwise) / world + wire / world


def modelled_loss_change(
    n_rows: int, n_cols: int, fraction: float, speed: DeviceSpeed,
    world: int = 1, batch: int = 1, ns_method: str = "gram", num_heads: Optional[int] = None,
    step_share: float = 1.0,
) -> float:
    """Modelled change of the final loss (nats) from stepping this matrix at ``fraction`` instead of
    1, at equal wall-clock time: what f costs at equal tokens (AUTO_LOSS_PER_WAITING_ROW_SHARE) less
    what the shorter iteration buys (AUTO_LOSS_PER_LOG_TIME), the iteration being the matrix's
    modelled forward and backward (AUTO_TOKENS_PER_STEP) plus its step. Negative: f pays.

    step_share: the share of the matrices whose forward and backward a rank computes that it steps
    (Megatron's layer-wise ZeRO-1: about 1 / DP), so each stepped matrix stands for 1 / step_share
    matrices' forward and backward."""
    def step(f: float) -> float:
        return estimated_step_seconds(n_rows, n_cols, f, speed, world, batch, ns_method, num_heads)

    forward_backward = 6 * n_rows * n_cols * AUTO_TOKENS_PER_STEP / speed.matmul_flops / step_share
    saved = math.log((forward_backward + step(1.0)) / (forward_backward + step(fraction)))
    return AUTO_LOSS_PER_WAITING_ROW_SHARE * (1 / fraction - 1) - AUTO_LOSS_PER_LOG_TIME * saved


def choose_fraction(
    n_rows: int, n_cols: int, speed: DeviceSpeed,
    world: int = 1, batch: int = 1, ns_method: str = "gram", num_heads: Optional[int] = None,
    step_share: float = 1.0,
) -> float:
    """The f that ``fraction="auto"`` uses for an n_rows x n_cols matrix.

    Among AUTO_FRACTIONS that select at least AUTO_MIN_ROWS rows (all of them for smaller
    matrices), the f with the lowest :func:`modelled_loss_change` (the larger f on a tie). Where
    the orthogonalization is a large share of the iteration (wide matrices, few tokens per rank, a
    slow link) a smaller f pays for its loss; where launches, memory or the model's own work
    dominate, f = 1 (at or below Muon's loss) is the choice.
    """
    floor = min(AUTO_MIN_ROWS, n_rows)
    feasible = [f for f in AUTO_FRACTIONS if selected_row_count(n_rows, f, num_heads) >= floor] or [1.0]
    change = {f: modelled_loss_change(n_rows, n_cols, f, speed, world, batch, ns_method, num_heads, step_share)
              for f in feasible}
    return min(feasible, key=lambda f: (change[f], -f))


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


def for_group(device: torch.device, dtype: torch.dtype, group: Optional[dist.ProcessGroup],
              step_share: float = 1.0) -> tuple[DeviceSpeed, float]:
    """This device's speed with the link of ``group``'s backend, and ``step_share``, agreed over the
    group's members (a collective when the group has more than one rank) so that all of them choose
    the same f: the slowest member's numbers, since a step that needs all of them waits for it, and
    the largest share (the member whose step weighs most in its iteration)."""
    speed = measure(device, dtype)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return speed, step_share
    link = _link_of(group)
    values = torch.tensor([speed.matmul_flops, -speed.launch_seconds, speed.memory_bytes_per_s, link, -step_share],
                          dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    flops, neg_launch, memory, link, neg_share = values.tolist()
    return DeviceSpeed(flops, -neg_launch, memory, link), -neg_share


def slowest(a: DeviceSpeed, b: DeviceSpeed) -> DeviceSpeed:
    """Each number of the two speeds at its slower value."""
    return DeviceSpeed(min(a.matmul_flops, b.matmul_flops), max(a.launch_seconds, b.launch_seconds),
                       min(a.memory_bytes_per_s, b.memory_bytes_per_s), min(a.link_bytes_per_s, b.link_bytes_per_s))


def agree_per_dtype(local: Sequence[tuple[torch.device, torch.dtype]],
                    group: Optional[dist.ProcessGroup]) -> dict[torch.dtype, DeviceSpeed]:
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
    return {dtype: DeviceSpeed(flops, -neg_launch, memory, link)
            for dtype, (flops, neg_launch, memory) in zip(order, values.tolist()) if flops != math.inf}


@dataclass(frozen=True)
class FractionRequest:
    """A batch of same-shape matrices whose f ``fraction="auto"`` chooses."""

    shape: tuple[int, int]
    batch: int  # matrices orthogonalized together (megabatching shares the launch cost)
    world: int  # ranks the batch's exchange spans (1: stepped where it lies)
    hp: Dion3Hyperparameters  # its ns_method, ns_dtype and num_heads
    device: torch.device
    group: Optional[dist.ProcessGroup] = None  # whose members agree on the speed (None: this rank alone)
    step_share: float = 1.0  # see modelled_loss_change


def _speed_key(device: torch.device, hp: Dion3Hyperparameters, group: Optional[dist.ProcessGroup]) -> tuple:
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None and dist.is_initialized() else ()
    return ranks, str(device), hp.ns_dtype or default_ns_dtype(device)


def resolve_fractions(
    requests: Sequence[FractionRequest],
    joined: Sequence[tuple[torch.device, Dion3Hyperparameters, dist.ProcessGroup]] = (),
    agreed: Optional[dict] = None,
) -> list[float]:
    """The f of each request: :func:`choose_fraction` on the speed and step share its group agrees on.

    One collective per (group, device, dtype), in the order of the groups' ranks, so that every
    member makes the same calls: a rank must call with the same groups as its peers, and names in
    ``joined`` (device, settings, group) those it agrees on without a request of its own.
    ``agreed``: what earlier calls agreed, by that key, updated here; a key found in it makes no
    collective (a caller that joined all its agreements at once passes it to keep later calls local).
    """
    agreed = {} if agreed is None else agreed
    wanted: dict[tuple, tuple] = {}
    for r in requests:  # a group's requests share its largest step share
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
        speed, share = agreed[_speed_key(r.device, r.hp, r.group)]
        out.append(choose_fraction(*r.shape, speed, r.world, r.batch, r.hp.ns_method, r.hp.num_heads, share))
    return out
