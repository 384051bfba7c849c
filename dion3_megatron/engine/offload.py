"""Offloaded state: an engine's Dion3 state lives in host memory and travels to the device for
its step, one shape group at a time.

Where a GPU steps it, the state (momentum, row variances, row ages) is allocated in pinned host
memory (:func:`.sharding.state_placement`). Each step (:class:`Streamer`) copies a group's state, and the
pieces of its weights and gradients that are on the host too (DeepSpeed's ZeRO-Offload keeps its
fp32 partitions there), into one of two device buffers, steps the group with the same exchange code
as ever, and copies what changed back: the next group's host-to-device copy runs on one side stream
while this group computes, the previous group's device-to-host copy on another, so the device
holds about two groups' worth, only during the step. :func:`step_on_device` does the same, in
bounded chunks and without overlap, for elementwise work on host tensors (AdamW on ZeRO's host
partitions).

Without a GPU there is nothing to offload to: :func:`step_device` is None and the engine steps as
it does without offload (its state is in host memory already).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .exchange import BlockExchange, Exchange, SubBatch

ALIGN = 512  # bytes: each tensor of a device buffer starts where a fresh allocation would


def step_device(offload: bool, device: torch.device) -> Optional[torch.device]:
    """The device an offloaded step of tensors on ``device`` runs on: that GPU; for host tensors
    the current CUDA device; None without offload or without a GPU (nothing to offload to)."""
    if not offload:
        return None
    if device.type == "cuda":
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


# --------------------------------------------------------------------------------------------
# What travels.


@dataclass(eq=False)
class Traveller:
    """A host tensor a group's step reads (and, if ``written``, changes): ``put`` makes the group
    use a given tensor in its place (a device copy for the step, the host tensor after it)."""

    host: torch.Tensor
    put: Callable[[torch.Tensor], None]
    written: bool = True


def _sub_batch_travellers(sub: SubBatch) -> list[Traveller]:
    """A sub-batch's state buffers (momentum and variance with their padded rows, the ages); its
    views of them follow each buffer put in place."""
    rows, kept = sub.momentum.shape[1], sub.variance.shape[1]
    momentum, variance = sub.momentum_padded, sub.variance_padded
    assert momentum is not None and variance is not None  # made with the sub-batch

    def put_momentum(t: torch.Tensor) -> None:
        sub.momentum_padded, sub.momentum = t, t[:, :rows]

    def put_variance(t: torch.Tensor) -> None:
        sub.variance_padded, sub.variance = t, t[:, :kept]

    out = [Traveller(momentum, put_momentum), Traveller(variance, put_variance)]
    if sub.age is not None:
        out.append(_attribute(sub, "age"))
    if sub.rounding is not None:  # a momentum below fp32: its count of steps (the shards' rounding_step)

        def put_steps(t: torch.Tensor) -> None:
            assert sub.rounding is not None
            sub.rounding = dataclasses.replace(sub.rounding, steps=t)

        out.append(Traveller(sub.rounding.steps, put_steps))
    return out


def _attribute(holder: object, name: str, written: bool = True) -> Traveller:
    return Traveller(getattr(holder, name), lambda t: setattr(holder, name, t), written)


def _entry(holder: dict, key: str) -> Traveller:
    return Traveller(holder[key], lambda t: holder.__setitem__(key, t))


def travellers(exchange: Exchange) -> list[Traveller]:
    """Everything of one group's step that lives in host memory: its state (in the exchange's
    buffers, or each shard's own), and the weights (written back) and gradients (read) of shards
    held there. Built at each step: gradients are new tensors every step."""
    sg = exchange.sg
    out: list[Traveller] = []
    if isinstance(exchange, BlockExchange):
        for sub in exchange.subs:
            out += _sub_batch_travellers(sub)
    else:
        out += [_entry(shard.state, key) for shard in sg.shards for key in sorted(shard.state)]
    for shard in sg.shards:
        if shard.weight.device.type == "cpu":
            out.append(_attribute(shard, "weight"))
        if shard.grad is not None and shard.grad.device.type == "cpu":
            out.append(_attribute(shard, "grad", written=False))
    return out


def _aligned(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def _carve(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous tensors shaped and typed like ``like``, laid out in a byte ``buffer``."""
    out, offset = [], 0
    for t in like:
        size = t.numel() * t.element_size()
        out.append(buffer[offset : offset + size].view(t.dtype).view(t.shape))
        offset += _aligned(t)
    return out


# --------------------------------------------------------------------------------------------
# The streamed step.


class Streamer:
    """Steps shape groups one at a time on ``device``, each group's travellers copied in before
    and the written ones copied back after; on a GPU through two side streams (host to device,
    device to host) and two buffers, which the groups take in turn, each as large as the largest
    group's travellers it takes: a group's copy in overlaps the previous group's step, its copy back
    the next group's. A GPU-less device
    (the tests' CPU) copies in place, in order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self._to_device = torch.cuda.Stream(device) if cuda else None
        self._to_host = torch.cuda.Stream(device) if cuda else None

    def run(self, groups: list[list[Traveller]], step: Callable[[int], None]) -> None:
        """``step(i)`` for every group i, with its travellers on the device meanwhile; returns once
        every host tensor holds its group's result."""
        if not groups:
            return
        sizes = [sum(_aligned(t.host) for t in group) for group in groups]
        # Group i uses buffer i % 2: each as large as the largest group it takes.
        buffers = [torch.empty(max(sizes[parity::2]), dtype=torch.uint8, device=self.device) for parity in range(min(2, len(groups)))]
        if self._to_device is None:
            for i, group in enumerate(groups):
                copies = _carve(buffers[i % 2], [t.host for t in group])
                for t, copy in zip(group, copies):
                    copy.copy_(t.host)
                self._step(group, copies, step, i)
                for t, copy in zip(group, copies):
                    if t.written:
                        t.host.copy_(copy)
            return
        self._run_streamed(groups, buffers, step)

    def _run_streamed(self, groups: list[list[Traveller]], buffers: list[torch.Tensor], step: Callable[[int], None]) -> None:
        to_device, to_host = self._to_device, self._to_host
        assert to_device is not None and to_host is not None  # a GPU's
        compute = torch.cuda.current_stream(self.device)
        to_device.wait_stream(compute)  # the buffers and the host tensors (a caller's copies) are ready
        copies: list[list[torch.Tensor]] = [[] for _ in groups]
        arrived: list[Optional[torch.cuda.Event]] = [None] * len(groups)
        freed: list[Optional[torch.cuda.Event]] = [None] * len(groups)

        def fetch(i: int) -> None:
            copies[i] = _carve(buffers[i % 2], [t.host for t in groups[i]])
            with torch.cuda.stream(to_device):
                if i >= 2:  # its buffer held group i - 2, whose copy back must be done
                    earlier = freed[i - 2]
                    assert earlier is not None  # recorded when group i - 2 was copied back
                    to_device.wait_event(earlier)
                for t, copy in zip(groups[i], copies[i]):
                    copy.copy_(t.host, non_blocking=True)
                arrived[i] = to_device.record_event()

        try:
            fetch(0)
            for i, group in enumerate(groups):
                if i + 1 < len(groups):
                    fetch(i + 1)
                event = arrived[i]
                assert event is not None  # recorded by fetch(i)
                compute.wait_event(event)
                self._step(group, copies[i], step, i)
                done = compute.record_event()
                with torch.cuda.stream(to_host):
                    to_host.wait_event(done)
                    for t, copy in zip(group, copies[i]):
                        if t.written:
                            t.host.copy_(copy, non_blocking=True)
                    freed[i] = to_host.record_event()
                copies[i] = []
        finally:
            # Every copy has run (each copy back after its group's step, each step after its copy
            # in): the host tensors hold the results, and nothing uses the buffers any more (also
            # where a step raised).
            to_device.synchronize()
            to_host.synchronize()

    @staticmethod
    def _step(group: list[Traveller], copies: list[torch.Tensor], step: Callable[[int], None], i: int) -> None:
        for t, copy in zip(group, copies):
            t.put(copy)
        try:
            step(i)
        finally:
            for t in group:
                t.put(t.host)


# --------------------------------------------------------------------------------------------
# Elementwise work on host tensors.

CHUNK = 1 << 24  # elements per tensor per round trip of step_on_device (64 MiB of fp32)


def step_on_device(
    device: torch.device,
    read: list[list[torch.Tensor]],
    written: list[list[torch.Tensor]],
    fn: Callable[[list[list[torch.Tensor]], list[list[torch.Tensor]]], None],
    chunk: int = CHUNK,
) -> None:
    """``fn(read, written)`` for elementwise work over lists of 1-D tensors of equal lengths (each
    inner list one operand, its i-th tensor the i-th run), run on ``device`` in chunks of at most
    ``chunk`` elements per run: each chunk's operands copied there, ``written`` copied back."""
    operands = read + written
    for i in range(len(operands[0]) if operands else 0):
        length = operands[0][i].numel()
        for start in range(0, length, chunk):
            size = min(chunk, length - start)
            pieces = [[op[i].narrow(0, start, size)] for op in operands]
            moved = [[p[0].to(device, non_blocking=True)] for p in pieces]
            fn(moved[: len(read)], moved[len(read) :])
            for host, copy in zip(pieces[len(read) :], moved[len(read) :]):
                host[0].copy_(copy[0])
