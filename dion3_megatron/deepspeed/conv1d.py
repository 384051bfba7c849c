"""GPT-2's ``Conv1D`` as a linear layer whose weight Dion3 can take.

Hugging Face's ``transformers.pytorch_utils.Conv1D`` stores its weight as (in_features,
out_features). Dion3 treats a matrix's rows as output features (row selection, NorMuon's per-row
variance, the sqrt(rows/cols) lr scale), and ZeRO cuts parameters row-major, so the
transposed layout cannot be stepped as its transpose: the config route gives Conv1D weights to
AdamW (:mod:`.groups`). :func:`conv1d_as_linear` swaps every Conv1D of a model, before training,
for :class:`Conv1DAsLinear`, which holds the same weight as (out, in), like ``nn.Linear``, so Dion3
takes it. Its state dict keeps Conv1D's (in, out) layout, so ``save_pretrained``, checkpoints and
``from_pretrained`` weights stay GPT-2's.
"""

from __future__ import annotations

from typing import Optional, cast

import torch


class Conv1DAsLinear(torch.nn.Module):
    """``y = x W^T + b`` with W (out, in): a Conv1D's function with ``nn.Linear``'s weight layout.
    ``state_dict`` / ``load_state_dict`` speak Conv1D's (in, out) layout."""

    def __init__(self, conv: torch.nn.Module) -> None:
        super().__init__()
        weight = conv.get_parameter("weight")
        self.nf = conv.nf  # Conv1D's names: out features
        self.nx = weight.shape[0]  # in features
        self.weight = torch.nn.Parameter(weight.detach().t().contiguous(), requires_grad=weight.requires_grad)
        self.bias = cast(Optional[torch.nn.Parameter], conv.bias)
        self._register_state_dict_hook(_save_as_conv1d)
        self.register_load_state_dict_pre_hook(_load_from_conv1d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.nx}, out_features={self.nf} (Conv1D's state-dict layout)"


def _save_as_conv1d(module: Conv1DAsLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        w = state_dict[key]
        state_dict[key] = w.t() if isinstance(w, torch.nn.Parameter) else w.t().contiguous()


def _load_from_conv1d(module: Conv1DAsLinear, state_dict: dict, prefix: str, *args) -> None:
    key = prefix + "weight"
    if key in state_dict and tuple(state_dict[key].shape) == (module.nx, module.nf):
        state_dict[key] = state_dict[key].t()
    elif key in state_dict and module.nx != module.nf:
        raise ValueError(f"{key}: expected Conv1D's layout {(module.nx, module.nf)}, got {tuple(state_dict[key].shape)}")


def conv1d_as_linear(model: torch.nn.Module) -> int:
    """Replace every Hugging Face ``Conv1D`` in ``model`` by ``Conv1DAsLinear`` (in place, the
    same values); returns how many. Call it before training (before ``Trainer`` or
    ``deepspeed.initialize``) so that Dion3 takes those weights."""
    from .groups import is_conv1d

    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if is_conv1d(child)]
    for parent, name, child in swaps:
        setattr(parent, name, Conv1DAsLinear(child))
    return len(swaps)
