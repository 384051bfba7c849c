"""AdamW for the tensors that do not take the Dion3 rule (embeddings, heads, norms, biases): the
same math as torch's AdamW, as multi-tensor ops over tensors that share a step count."""

from __future__ import annotations

import torch


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """Decoupled-weight-decay Adam with bias correction for tensors that share ``step`` (from 1)
    and the settings: multi-tensor ops, a handful of kernels for any number of tensors."""
    if not params:
        return
    lr = float(lr)  # a 0-d tensor lr (torch's optimizers take one) as its number
    beta1, beta2 = betas
    g = [grad.to(m.dtype) for grad, m in zip(grads, exp_avgs)]
    torch._foreach_lerp_(exp_avgs, g, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1 - beta2)
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    denom = torch._foreach_div(exp_avg_sqs, bias2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, bias1)
    torch._foreach_div_(update, denom)
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, [u.to(p.dtype) for u, p in zip(update, params)], alpha=-lr)
