"""Test helpers for the Megatron tests: a tiny GPT on CPU, the single-process reference, and
Megatron's training step. The CPU shim itself is ``examples/megatron_cpu.py`` (the main job's), the
GPT the examples' (``examples/small_gpt.py``)."""

from __future__ import annotations

import torch

from examples.megatron_cpu import install  # noqa: F401 - the tests call megatron_shim.install()
from examples.small_gpt import megatron_config, megatron_gpt

# ------------------------------------------------------------------------------------------------
# A tiny GPT on CPU for the Megatron tests (call install() first).

VOCAB = 128
SEQ = 16


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """(Re)initialize Megatron's model-parallel state on the already-initialized gloo world."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    model_parallel_cuda_manual_seed(1234)


def tiny_config(tp: int = 1, pp: int = 1, ep: int = 1, bf16: bool = False, num_experts: int | None = None, **kw):
    """The small GPT at 2 layers of width 64 (4 heads, 2 query groups); ``kw`` sets other fields."""
    more = dict(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, sequence_parallel=False)
    if num_experts:
        more.update(
            num_moe_experts=num_experts,
            moe_router_topk=2,
            moe_ffn_hidden_size=64,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
        )
    more.update(kw)
    return megatron_config(
        layers=2, hidden=64, heads=4, query_groups=2, ffn=128, tp=tp, dtype=torch.bfloat16 if bf16 else torch.float32, init_std=0.05, **more
    )


def build_gpt(config, seed: int = 7):
    torch.manual_seed(seed)
    return megatron_gpt(config, VOCAB, SEQ)


def batches(steps: int, global_batch: int, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g) for _ in range(steps)]


# ------------------------------------------------------------------------------------------------
# Training loop and the single-process reference (plain dion3_megatron.Dion3 on logical matrices).

LR = 0.02
WD = 0.1
# adam_eps not 1e-8: on near-zero grads fp32 summation order would flip Adam's first step.
ADAM = dict(adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-5)
DION3 = dict(fraction=0.25, mu=0.95, beta2=0.95)


def _is_embedding_or_output(name: str) -> bool:
    return "word_embeddings" in name or "output_layer" in name


def logical_split(name: str, full: torch.Tensor, config) -> list[torch.Tensor]:
    """The logical matrices of a full (TP=1) weight, written independently of the code under test."""
    if name.endswith("linear_qkv.weight"):
        groups = config.num_query_groups
        q = config.num_attention_heads // groups * config.kv_channels
        sizes = [q, config.kv_channels, config.kv_channels]
        parts = torch.split(full.view(groups, sum(sizes), -1), sizes, dim=1)
        return [p.reshape(-1, full.shape[-1]).clone() for p in parts]
    if name.endswith("linear_fc1.weight") and config.gated_linear_unit:
        return [p.clone() for p in full.chunk(2, dim=0)]
    return [full.clone()]


def logical_join(name: str, parts: list[torch.Tensor], config, shape) -> torch.Tensor:
    if name.endswith("linear_qkv.weight"):
        groups = config.num_query_groups
        return torch.cat([p.view(groups, -1, shape[-1]) for p in parts], dim=1).reshape(shape)
    return torch.cat(parts, dim=0).reshape(shape)


class Reference:
    """The unsharded model trained by single-process dion3_megatron.Dion3 (fp32)."""

    def __init__(self, config, seed: int = 7, **dion3):
        from dion3_megatron import Dion3

        self.config = config
        self.model = build_gpt(config, seed=seed)
        self.names = dict(self.model.named_parameters())
        self.leaves: dict[str, list[torch.Tensor]] = {}
        matrices, embeddings, vectors = [], [], []
        for name, p in self.names.items():
            if p.dim() == 2 and not _is_embedding_or_output(name):
                self.leaves[name] = [t.requires_grad_(False) for t in logical_split(name, p.data, config)]
                matrices += self.leaves[name]
            elif p.dim() == 2:
                embeddings.append(p)
            else:
                vectors.append(p)
        hp = {**DION3, **dion3}
        self.opt = Dion3(
            [
                dict(params=matrices, algorithm="dion3", weight_decay=WD, eps=1e-8),
                dict(params=embeddings, algorithm="adamw", weight_decay=WD, eps=ADAM["adam_eps"]),
                dict(params=vectors, algorithm="adamw", weight_decay=0.0, eps=ADAM["adam_eps"]),
            ],
            lr=LR,
            betas=(ADAM["adam_beta1"], ADAM["adam_beta2"]),
            **hp,
        )

    def step(self, batch: torch.Tensor, lr: float = LR, clip_grad: float = 0.0) -> float:
        self.model.zero_grad(set_to_none=True)
        tokens, labels = batch[:, :-1], batch[:, 1:]
        pos = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
        loss = self.model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        if clip_grad:  # Megatron's rule: scale by max_norm / (norm + 1e-6) when that is < 1
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.names.values()]))
            coeff = clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                for p in self.names.values():
                    p.grad.mul_(coeff)
        for group in self.opt.param_groups:
            group["lr"] = lr
        for name, leaves in self.leaves.items():
            p = self.names[name]
            for leaf, data, grad in zip(leaves, logical_split(name, p.data, self.config), logical_split(name, p.grad, self.config)):
                leaf.data.copy_(data)
                leaf.grad = grad
        self.opt.step()
        with torch.no_grad():
            for name, leaves in self.leaves.items():
                p = self.names[name]
                p.copy_(logical_join(name, [t.data for t in leaves], self.config, p.shape))
        return loss.item()

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.names.items()}


def local_name_to_global(name: str, config) -> str:
    """A pipeline/expert-parallel rank's local parameter name -> the unsharded model's name."""
    import re

    from megatron.core import parallel_state as ps

    while name.startswith("module."):
        name = name[len("module.") :]
    pp_rank = ps.get_pipeline_model_parallel_rank()
    per_stage = config.num_layers // ps.get_pipeline_model_parallel_world_size()
    name = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + pp_rank * per_stage}.", name, count=1)
    if config.num_moe_experts:
        ep_rank = ps.get_expert_model_parallel_rank()
        local = config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + ep_rank * local}.", name)
    return name


def local_slice(name: str, param: torch.Tensor, full: torch.Tensor, config) -> torch.Tensor:
    """What a TP rank holds of the full tensor ``full`` for model parameter ``param``."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    expert = "experts" in name
    tp = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
    rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
    if tp == 1:
        return full
    dim = param.partition_dim
    if dim == 0 and name.endswith("linear_fc1.weight") and config.gated_linear_unit:
        return torch.cat([h.chunk(tp, dim=0)[rank] for h in full.chunk(2, dim=0)], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def load_reference_weights(model, ref_state: dict, config) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(local_slice(name, p, ref_state[local_name_to_global(name, config)], config))


def max_diff_to_reference(model, ref_state: dict, config) -> tuple[float, int]:
    worst, count = 0.0, 0
    for name, p in model.named_parameters():
        expected = local_slice(name, p, ref_state[local_name_to_global(name, config)], config)
        worst = max(worst, (p.detach().float() - expected.float()).abs().max().item())
        count += 1
    return worst, count


def make_parallel(
    config,
    ref_init: dict,
    *,
    layer_wise: bool = True,
    bf16: bool = False,
    clip_grad: float = 0.0,
    init_lr: float = LR,
    warmup: int = 0,
    overlap: bool = False,
    fsdp2: bool = False,
    **dion3,
):
    """Model chunk (DDP, or with ``fsdp2`` Megatron's torch FSDP2 wrapper) + Megatron optimizer
    (optimizer='dion3') + lr scheduler, like pretrain()."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training.training import wrap_model_chunks_with_ddp

    model = build_gpt(config)
    load_reference_weights(model, ref_init, config)
    # overlap: --overlap-grad-reduce --overlap-param-gather (the all-gather moves to the next forward)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=layer_wise, grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, overlap_param_gather=overlap
    )
    if fsdp2:  # --use-torch-fsdp2: no distributed optimizer, the parameters are row-sharded DTensors
        from megatron.core.distributed import TorchFullyShardedDataParallel

        layer_wise = ddp_config.use_distributed_optimizer = False
        config.transformer_impl = "local"  # as --transformer-impl local: FSDP2 units are the layers, not their linears
        chunks = [TorchFullyShardedDataParallel(config, ddp_config, model)]
    else:
        chunks = wrap_model_chunks_with_ddp([model], config, ddp_config, use_layer_wise_distributed_optimizer=layer_wise)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = chunks[0].no_sync
    ocfg = OptimizerConfig(
        optimizer="dion3",
        lr=LR,
        min_lr=LR,
        weight_decay=WD,
        bf16=bf16,
        clip_grad=clip_grad,
        use_distributed_optimizer=layer_wise,
        use_layer_wise_distributed_optimizer=layer_wise,
        overlap_param_gather=overlap,
        **ADAM,
    )
    for key, value in {**DION3, **dion3}.items():
        setattr(ocfg, f"dion3_{key}", value)
    opt = get_megatron_optimizer(ocfg, chunks)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=init_lr,
        max_lr=LR,
        min_lr=LR,
        lr_warmup_steps=warmup,
        lr_decay_steps=100,
        lr_decay_style="constant",
        start_wd=WD,
        end_wd=WD,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )
    return chunks, opt, sched


def train_step(chunks, opt, sched, batch: torch.Tensor, num_microbatches: int = 1, loss_scale: float = 1.0):
    """One Megatron training step on this data-parallel rank's share of the global ``batch``; as
    Megatron-LM's train_step, the lr scheduler steps only when the update was made. ``loss_scale``
    multiplies this rank's loss (NaN: a bad batch on one rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = batch.chunk(dp)[dp_rank]
    micro = local.chunk(num_microbatches)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        tokens, labels = b[:, :-1], b[:, 1:]
        pos = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
        out = model(tokens, pos, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean() * loss_scale
            return loss, {"loss": loss.detach()}

        return out, loss_func

    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=micro[0].shape[0],
        forward_only=False,
    )
    ok, grad_norm, _ = opt.step()
    if ok:
        sched.step(1)
    return losses, ok, grad_norm
