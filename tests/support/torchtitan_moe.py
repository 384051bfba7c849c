"""torchtitan's MoE on CPU: its deepseek_v3 model (multi-head latent attention, a dense first layer,
then MoE layers of routed experts and a shared expert), shrunk, parallelized by its own
``parallelize_deepseekv3`` on a gloo mesh with FSDP2 alone, with expert parallelism or with tensor
parallelism, the optimizer built by its ``OptimizersContainer`` from
:func:`dion3_megatron.torchtitan.optimizer_config`, checkpoints through its ``CheckpointManager``;
and the single-process reference: the same model whole, ``dion3_megatron.Dion3`` on the matrices
:data:`~dion3_megatron.torchtitan.HIDDEN_MATRICES` names (the 3-D experts as batches of matrices)
and torch's AdamW on the rest.

Batches, loss, step order, optimizer container and checkpoint manager are those of
:mod:`support.torchtitan_helpers`. Besides what that module lists (SDPA attention, FSDP's plain sum,
a "cpu" device mesh), three things differ from torchtitan's GPU trainer, none of them in the
optimizer:

- the routed experts compute in the parameters' dtype (fp32): torchtitan 0.3.0's
  ``GroupedExperts`` casts weights and tokens to bf16 for ``torch._grouped_mm``, so each rank's
  expert gradients would be rounded to bf16 before FSDP adds them, and no layout could equal the
  single process within fp32 rounding (with them, the experts after three steps differ by 5e-4 to
  3e-2). :class:`GroupedExpertsInParamDtype` (the same parameters,
  initialization and sharding; torchtitan's own ``_grouped_mm`` seam, which runs on CPU in fp32)
  takes its place in the config, as torchtitan's MXFP8 converter swaps in its subclass;
- with expert parallelism, torchtitan's ``spmd_backend="partial_dtensor"``: under its default
  ``"spmd_types"`` the token dispatch is a list ``all_to_all``, which gloo refuses for uneven
  token counts; ``"partial_dtensor"`` dispatches with ``all_to_all_single`` and split sizes,
  which gloo takes. FSDP2 alone runs under the default;
- the load-balancing bias is off (``load_balance_coeff=None``): torchtitan's trainer registers its
  update (``register_moe_load_balancing_hook``) as a pre-hook of the optimizers' step; it moves
  routing, not weights, and the reference has no container to hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts

from support import torchtitan_helpers as helpers

DIM, VOCAB = helpers.DIM, helpers.VOCAB  # the batches and the loss are torchtitan_helpers'
HEADS, LAYERS, DENSE_LAYERS = 4, 2, 1
EXPERTS, TOP_K, EXPERT_HIDDEN, DENSE_HIDDEN = 4, 2, 32, 128


class Layout(NamedTuple):
    """Expert-parallel and tensor-parallel degrees (the rest of the world shards: FSDP2; with
    expert parallelism the experts are split over the ep ranks and FSDP2 shards them over
    world / ep), and the model's routed experts and how many each token takes."""

    ep: int = 1
    tp: int = 1
    experts: int = EXPERTS
    top_k: int = TOP_K


# At 2 ranks: FSDP2 shards the experts by experts; expert parallelism puts 2 experts on each rank;
# tensor parallelism splits each expert's w1/w3 by rows and w2 by columns (torchtitan's dense TP
# plan of experts when expert parallelism is off).
LAYOUTS = {"fsdp": Layout(), "ep": Layout(ep=2), "tp": Layout(tp=2)}
# At 4 ranks, expert parallelism 2 with FSDP2 over the 2 ranks of each expert group: with 4 experts
# FSDP2 shards them by experts (one a rank); with 2 experts (fewer than the 4 ranks holding them),
# torchtitan's FSDP2 shards them by rows (Shard(1)): each rank holds half the rows of its expert.
LAYOUTS_4 = {"ep x efsdp": Layout(ep=2), "ep x efsdp, rows": Layout(ep=2, experts=2, top_k=1)}


class GroupedExpertsInParamDtype(GroupedExperts):
    """torchtitan's ``GroupedExperts`` (the same parameters ``w1_EFD``, ``w2_EDF``, ``w3_EFD``,
    initialization and sharding) computing its SwiGLU experts in the parameters' dtype through its
    ``_grouped_mm`` seam: h = silu(x w1^T) * (x w3^T), out = h w2^T, expert by expert over the token
    offsets."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.to(w1.dtype)
        gate = self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offsets)
        up = self._grouped_mm(A=x, B_t=w3.transpose(-2, -1), offs=offsets)
        return self._grouped_mm(A=F.silu(gate) * up, B_t=w2.transpose(-2, -1), offs=offsets).type_as(x_RD)


def model_config(experts: int = EXPERTS, top_k: int = TOP_K):
    """torchtitan's deepseek_v3 debug model shrunk: two layers of width 64 (the first dense), ``experts``
    routed experts of which each token takes ``top_k``, one shared expert, MLA without a query LoRA."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

    layers = _build_dsv3_layers(
        n_layers=LAYERS,
        n_dense_layers=DENSE_LAYERS,
        dim=DIM,
        n_heads=HEADS,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mscale=0.7,
        dense_hidden_dim=DENSE_HIDDEN,
        moe_hidden_dim=EXPERT_HIDDEN,
        num_experts=experts,
        num_shared_experts=1,
        router_top_k=top_k,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=helpers.SEQ, theta=10000.0, scaling="none"),
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if layer.moe is not None:
            layer.moe.load_balance_coeff = None
            stock = layer.moe.routed_experts.inner_experts
            layer.moe.routed_experts.inner_experts = GroupedExpertsInParamDtype.Config(
                **{f.name: getattr(stock, f.name) for f in dataclasses.fields(stock)}
            )
    return DeepSeekV3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        layers=layers,
        mtp_layers=[],
        **helpers.ends(),
    )


def built_model(experts: int = EXPERTS, top_k: int = TOP_K, parallelism=None) -> torch.nn.Module:
    """The model with its initial weights, the same on every rank and in the reference; with
    ``parallelism`` (torchtitan's ParallelismConfig), its sharding declared for parallelize_deepseekv3."""
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    config = model_config(experts, top_k)
    if parallelism is not None:
        set_deepseek_v3_sharding_config(
            config, enable_sp=parallelism.enable_sequence_parallel, enable_ep=parallelism.expert_parallel_degree > 1
        )
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for p in model.parameters():  # norms off 1, so that their AdamW steps differ by tensor
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


_DIMS: dict[tuple[int, int, int], object] = {}  # torchtitan's ParallelDims by (world size, ep, tp)


def parallelized(world: int, layout: Layout):
    """The model on ``world`` gloo ranks, parallelized by torchtitan's ``parallelize_deepseekv3`` in
    ``layout``, and a ``Shard``: the context of its passes (the SPMD backend and torchtitan's SPMD
    context of those meshes) and this rank's rows of the global batch."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    parallel_dims.device_type = "cpu"
    ep, tp = layout.ep, layout.tp
    backend = "spmd_types" if ep == 1 else "partial_dtensor"
    parallelism = ParallelismConfig(expert_parallel_degree=ep, tensor_parallel_degree=tp, spmd_backend=backend)
    if (world, ep, tp) not in _DIMS:  # one mesh per layout, as in a trainer's process
        _DIMS[world, ep, tp] = ParallelDims.from_config(parallelism, world)
        _DIMS[world, ep, tp].build_mesh()
    dims = _DIMS[world, ep, tp]
    spmd = dist_utils.get_spmd_context(parallel_dims=dims)

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        before = dist_utils.get_spmd_backend()
        dist_utils.set_spmd_backend(backend)  # (the trainer sets it from the config)
        try:
            with spmd():
                yield
        finally:
            dist_utils.set_spmd_backend(before)

    model = built_model(layout.experts, layout.top_k, parallelism)
    return helpers.parallelized_by(parallelize_deepseekv3, model, dims, parallelism, context, world)


def placements(model) -> dict[str, tuple]:
    """Each DTensor parameter's placements."""
    return {n: tuple(p.placements) for n, p in model.named_parameters() if hasattr(p, "placements")}


def dion3_state(optimizers) -> dict[str, dict[str, torch.Tensor]]:
    """The whole (logical) Dion3 state of every matrix, by parameter name: momentum and the per-row
    variance, gathered from the pieces the ranks hold as placed (a collective under DTensor)."""
    from dion3_megatron import Dion3

    out = {}
    for o in optimizers:
        if isinstance(o, Dion3):
            for group in helpers.by_rule(o)[0]:
                for p, name in zip(group["params"], group["param_names"]):
                    out[name] = {
                        part: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                        for part, v in o.state[p].items()
                        if part in ("momentum", "variance")
                    }
    return out


def session(rank: int, world: int, layouts: dict[str, Layout], resume: str, settings: dict, folder: str) -> dict:
    """Three steps in each layout: the parameters after them, their placements and the Dion3 state;
    the layout ``resume`` also saved after step 2 through CheckpointManager, then resumed by a fresh
    model and optimizer that take step 3; then rank 0 alone (a world of one, FSDP2 over itself)
    resumes that checkpoint while the next ranks run the reference of each model (by its experts)."""
    import torch.distributed as dist

    out: dict = {"cases": {}}
    for name, layout in layouts.items():
        model, shard = parallelized(world, layout)
        optimizers = helpers.container(model, settings)
        helpers.train(model, optimizers, range(helpers.STEPS), shard)
        out["cases"][name] = {
            "params": helpers.full_params(model),
            "state": dion3_state(optimizers),
            "placements": placements(model),
            "types": [type(o).__name__ for o in optimizers],
        }
    out["resumed"] = resumed(world, layouts[resume], settings, folder)
    dist.barrier()
    dist.destroy_process_group()
    models = sorted({(layout.experts, layout.top_k) for layout in layouts.values()})
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        one = Layout(experts=layouts[resume].experts, top_k=layouts[resume].top_k)
        out["resumed at one rank"] = resumed(1, one, settings, folder, save=False)
    elif rank <= len(models):
        out["reference"] = reference(settings, *models[rank - 1])
    return out


def resumed(world: int, layout: Layout, settings: dict, folder: str, save: bool = True) -> dict[str, torch.Tensor]:
    """Steps 1-2 saved at step 2 by torchtitan's CheckpointManager (unless not ``save``: saved
    before, in another layout), then a fresh model and optimizer load it and take step 3."""
    return helpers.resumed_from(lambda: helpers.trainable(*parallelized(world, layout)), settings, folder, save)


def reference(settings: dict, experts: int = EXPERTS, top_k: int = TOP_K) -> dict:
    """The single-process run: the whole model, Dion3 on the matrices the default regex names and
    torch's AdamW on the rest, with the settings optimizer_config hands each; the model's experts
    and top-k, the parameters after three steps and the Dion3 state."""
    from dion3_megatron.torchtitan import HIDDEN_MATRICES

    model = built_model(experts, top_k)
    dion3 = helpers.stepped_whole(model, settings)
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if re.search(HIDDEN_MATRICES, n)]
    state = {n: {part: dion3.state[p][part].clone() for part in ("momentum", "variance")} for n, p in hidden}
    return {"model": (experts, top_k), "params": {n: p.detach().clone() for n, p in named}, "state": state}
