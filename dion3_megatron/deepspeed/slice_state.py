"""The slice-shaped state of a ZeRO partition (:mod:`.zero` lists its keys): created where absent,
``exp_avg`` in the dtype its group's momentum is stored in, and DeepSpeed's views of a state tensor
taken again where one was replaced."""

from __future__ import annotations

import torch


def init_slice_state(
    state: dict, flat: torch.Tensor, with_age: bool = False, pinned: bool = False, momentum_dtype: torch.dtype = torch.float32
) -> bool:
    """Create the slice-shaped state of a flat partition if absent (on the slice's device;
    ``pinned``: a host slice's, in pinned memory): ``exp_avg`` in ``momentum_dtype`` (a Dion3
    group's; one that holds another dtype, as a universal checkpoint's load leaves it, converted),
    the rest fp32; ``with_age``: the rows' ages too (staleness), 0 where absent, as in a fresh run.
    True where ``exp_avg`` was converted (a new tensor)."""
    converted = "exp_avg" in state and state["exp_avg"].dtype != momentum_dtype
    if converted:
        state["exp_avg"] = torch.empty(flat.shape, dtype=momentum_dtype, device=flat.device, pin_memory=pinned).copy_(state["exp_avg"])
    for key in ("exp_avg", "exp_avg_sq", "row_age") if with_age else ("exp_avg", "exp_avg_sq"):
        if key not in state:
            dtype = momentum_dtype if key == "exp_avg" else torch.float32
            state[key] = torch.zeros(flat.shape, dtype=dtype, device=flat.device, pin_memory=pinned)
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
    elif not torch.is_tensor(state["step"]):
        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
    return converted


def relink_fragments(params: list[torch.Tensor], flat: torch.Tensor, state: dict) -> None:
    """After a state tensor of ``flat`` was replaced: DeepSpeed's views of it taken again (the
    ``_hp_mapping`` of each of ``params`` that ZeRO-1/2 linked, which ``safe_get_full_optimizer_state``
    reads; ZeRO-3 reads the state itself)."""
    for p in params:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None and mapping.optim_fragment is not None:
            mapping.set_optim_state_fragment(flat, state)
