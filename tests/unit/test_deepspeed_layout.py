"""ZeRO-1/2's slice layout: every rank's element ranges are gathered where the step computes, not
where the slice lies. Under ``offload_optimizer`` the slice lies in host memory while DeepSpeed's
data-parallel group is NCCL's, which carries no CPU tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from dion3_megatron.deepspeed import layout


def _linked(start: int, numel: int, group: object) -> torch.nn.Parameter:
    """A parameter as ZeRO-1/2 links it to its flat slice: elements [start, start + numel) of the
    run, all of them in this rank's slice (one rank)."""
    p = torch.nn.Parameter(torch.randn(numel))
    address = SimpleNamespace(start=start, numel=numel)
    p._hp_mapping = SimpleNamespace(lp_fragment_address=address, hp_fragment_address=address)  # type: ignore[attr-defined]
    p._dp_group = group  # type: ignore[attr-defined]
    return p


def test_the_slice_ranges_are_gathered_on_the_step_device_not_where_the_slice_lies(monkeypatch):
    gathered_on = []

    def all_gather_into_tensor(out: torch.Tensor, mine: torch.Tensor, group: object = None) -> None:
        gathered_on.append({out.device.type, mine.device.type})
        out.copy_(mine)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather_into_tensor)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    group = object()
    params = [_linked(0, 6, group), _linked(6, 4, group)]
    # the slice on a device the group cannot carry (meta stands for the host under NCCL)
    flat = torch.empty(10, device="meta")

    laid = layout.slice_layout(flat, params, "Dion3 param group 0", torch.device("cpu"))

    assert gathered_on == [{"cpu"}]
    assert laid.ranges.tolist() == [[[0, 6], [6, 10]]]
    assert laid.starts == [0, 6] and laid.flat is flat
