"""torchtitan on CPU: its llama3 model (the debug model's builder, shrunk), parallelized by its own
``parallelize_llama`` on a gloo mesh, the optimizer built by its ``OptimizersContainer`` from
:func:`dion3_megatron.torchtitan.optimizer_config`, checkpoints through its ``CheckpointManager``;
and the single-process reference: the same model whole, ``dion3_megatron.Dion3`` on the hidden
matrices and torch's AdamW on the rest, built without torchtitan's optimizer code.

Three things differ from torchtitan's GPU trainer, none of them in the optimizer: the attention
kernel is torch's SDPA (FlexAttention has no backward on CPU; the attention has no parameters),
FSDP reduces gradients with a plain sum (gloo has no PREMUL_SUM, torchtitan's reduction with its
gradient division turned off; the loss is divided by the global count as torchtitan does), and the
device mesh is built on "cpu" (torchtitan takes the accelerator's device type, "cuda" without one).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, NamedTuple

import torch

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, HIDDEN = 64, 4, 2, 2, 256, 160
BATCH, SEQ = 4, 16  # the global batch of every step
STEPS = 3
# (data-parallel replicate, tensor-parallel) degrees; the rest of the world shards (FSDP2)
LAYOUTS = {"fsdp": (1, 1), "hsdp": (2, 1), "tp": (1, 2)}
# The optimizer settings of the torchtitan tests: Newton-Schulz in fp64, so that a distributed run
# differs from the single-process one by fp32 rounding alone (support.equality.TOL).
SETTINGS = {"lr": 0.02, "adamw_lr": 0.003, "weight_decay": 0.01, "fraction": 0.5, "ns_dtype": torch.float64}


def model_config(n_layers: int = LAYERS):
    """torchtitan's llama3 debug model (fused QKV, SwiGLU, RMSNorm, untied head), shrunk, with
    ``n_layers`` layers."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    layers = _build_llama3_layers(
        n_layers=n_layers,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        hidden_dim=HIDDEN,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        layers=layers,
        **ends(),
    )


def ends() -> dict:
    """The token embedding, final norm and untied output head of the shrunk models, as config fields."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return dict(
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init={"weight": lambda w: torch.nn.init.normal_(w, std=DIM**-0.5)}
        ),
    )


def built_model(parallelism=None, n_layers: int = LAYERS) -> torch.nn.Module:
    """The model (of ``n_layers`` layers) with its initial weights, the same on every rank and in the
    reference; with ``parallelism`` (torchtitan's ParallelismConfig), its sharding declared for
    parallelize_llama."""
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = model_config(n_layers)
    if parallelism is not None:
        set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, p in model.named_parameters():  # norms off 1, so that their AdamW steps differ by tensor
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """The sum of the squared logits this rank holds over the global count: the ranks' losses add
    up to the mean over the global batch (tensor parallelism splits the vocabulary)."""
    return logits.float().square().sum() / (BATCH * SEQ * VOCAB)


def positions() -> torch.Tensor:
    return torch.arange(SEQ).repeat(BATCH, 1)


class Shard(NamedTuple):
    """What a rank runs its passes in and on."""

    context: Callable[[], ContextManager] = contextlib.nullcontext
    rows: slice = slice(None)


WHOLE = Shard()
_DIMS: dict[tuple[int, str], object] = {}  # torchtitan's ParallelDims by (world size, layout)


def parallelized(world: int, layout: str):
    """The model on ``world`` gloo ranks, parallelized by torchtitan's ``parallelize_llama``, and the
    context of its forward and backward passes (torchtitan's SPMD context of those meshes) and this
    rank's share of the batch (rows of the global batch) as a ``Shard``."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import get_spmd_context
    from torchtitan.models.llama3.parallelize import parallelize_llama

    parallel_dims.device_type = "cpu"
    replicate, tp = LAYOUTS[layout]
    parallelism = ParallelismConfig(data_parallel_replicate_degree=replicate, tensor_parallel_degree=tp)
    if (world, layout) not in _DIMS:  # one mesh per layout, as in a trainer's process (torch keeps its sub-meshes)
        _DIMS[world, layout] = ParallelDims.from_config(parallelism, world)
        _DIMS[world, layout].build_mesh()
    dims = _DIMS[world, layout]
    context = get_spmd_context(parallel_dims=dims)
    model = built_model(parallelism)  # (outside the context: its initialization is of the whole tensors)
    return parallelized_by(parallelize_llama, model, dims, parallelism, context, world)


def parallelized_by(parallelize, model, dims, parallelism, context: Callable[[], ContextManager], world: int):
    """``model`` parallelized by torchtitan's ``parallelize`` function of its model family (inside
    ``context``: these meshes, not those of a model parallelized before in this process), with
    FSDP's plain sum of gradients, and its ``Shard``: ``context`` and this rank's rows of the global
    batch (the ranks of one tensor-parallel group, the mesh's innermost dimension, share rows)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig

    with context():
        model = parallelize(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
        )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    tp = parallelism.tensor_parallel_degree
    rank, share = torch.distributed.get_rank(), BATCH * tp // world
    return model, Shard(context, slice(rank // tp * share, (rank // tp + 1) * share))


def container(model: torch.nn.Module | list[torch.nn.Module], settings: dict):
    """torchtitan's optimizer for ``model`` (or a list of model parts: one Dion3 per part), built by
    its config's ``build`` (Dion3 registered)."""
    from dion3_megatron.torchtitan import optimizer_config, register

    register()
    return optimizer_config(**settings).build(model_parts=model if isinstance(model, list) else [model])


def one_dion3(model: torch.nn.Module, settings: dict, matrices: set[str]):
    """torchtitan's optimizer for ``model`` (:func:`container`), checked to be one Dion3 that steps
    exactly the parameters named ``matrices`` by the Dion3 rule and the rest by AdamW; the
    container, the Dion3 rule's groups and the AdamW groups."""
    from dion3_megatron import Dion3

    optimizers = container(model, settings)
    (dion3,) = optimizers.optimizers
    assert isinstance(dion3, Dion3)
    rule, adamw = by_rule(dion3)
    assert {n for g in rule for n in g["param_names"]} == matrices
    assert {n for g in adamw for n in g["param_names"]} == {n for n, _ in model.named_parameters()} - matrices
    return optimizers, rule, adamw


def by_rule(dion3) -> tuple[list[dict], list[dict]]:
    """A Dion3's param groups stepped by the Dion3 rule, and those stepped by AdamW."""
    adamw = [g for g in dion3.param_groups if g.get("algorithm") == "adamw"]
    return [g for g in dion3.param_groups if g.get("algorithm") != "adamw"], adamw


def poisoned_step(parts: list[torch.nn.Module], optimizers, poison: bool) -> dict:
    """A step of fresh random gradients, with (``poison``) this rank's first AdamW tensor's
    gradient NaN: whether every parameter of ``parts`` kept its value, and each Dion3's count of
    skipped steps."""
    gen = torch.Generator().manual_seed(5)
    before = []
    for part in parts:
        for p in part.parameters():
            before.append(p.detach().clone())
            values = torch.randn(p.shape, generator=gen)
            p.grad = distribute_like(p, values)
    if poison:
        _, adamw = by_rule(optimizers.optimizers[0])
        first = adamw[0]["params"][0].grad
        (first.to_local() if hasattr(first, "to_local") else first).fill_(float("nan"))
    optimizers.step()
    after = [p.detach() for part in parts for p in part.parameters()]
    unchanged = all(torch.equal(getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)) for a, b in zip(before, after))
    return {"unchanged": unchanged, "skipped": [o.skipped_steps for o in optimizers.optimizers]}


def distribute_like(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` (the parameter's full shape, the same on every rank) placed like ``p``."""
    if not hasattr(p, "placements"):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, p.device_mesh, p.placements)


def train(model, optimizers, steps: range, shard: Shard = WHOLE) -> None:
    """torchtitan's step order: forward and backward, the optimizers' step, zero_grad."""
    for tokens in batches()[steps.start : steps.stop]:
        with shard.context():
            loss_of(model(tokens[shard.rows], positions()[shard.rows])).backward()
        optimizers.step()
        optimizers.zero_grad()


def full_params(model) -> dict[str, torch.Tensor]:
    """The whole parameters of ``model`` (or of a list of model parts), by name."""
    parts = model if isinstance(model, list) else [model]
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for part in parts for n, p in part.named_parameters()}


def state_dtypes(optimizers) -> dict[str, torch.dtype]:
    """The dtype of every state tensor of the container's optimizers, by ``<parameter name>.<key>``."""
    return {
        f"{name}.{key}": value.dtype
        for o in optimizers
        for group in o.param_groups
        for name, p in zip(group["param_names"], group["params"])
        for key, value in o.state[p].items()
    }


def checkpointer(folder: str, model, optimizers):
    """torchtitan's CheckpointManager over the model (or a list of model parts), its optimizers and
    an LR schedule that keeps the configured lr (the reference steps at it)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    schedulers = LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0).build(optimizers=optimizers, training_steps=STEPS)
    parts = model if isinstance(model, list) else [model]
    manager = CheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0).build(
        dataloader=None, model_parts=parts, optimizers=optimizers, lr_schedulers=schedulers, states={}, sd_adapter=None
    )
    return manager, schedulers


def session(rank: int, world: int, layouts: list[str], settings: dict, folder: str) -> dict:
    """Three steps of each layout, the parameters after them; each layout also saved after step 2
    through CheckpointManager (a folder per layout), then resumed by a fresh model and optimizer that
    take step 2; then rank 0 alone (a world of one, FSDP2 over itself) resumes each checkpoint while
    rank 1 runs the reference."""
    import torch.distributed as dist

    out: dict = {"cases": []}
    for layout in layouts:
        model, shard = parallelized(world, layout)
        optimizers = container(model, settings)
        train(model, optimizers, range(STEPS), shard)
        out["cases"].append(
            {"params": full_params(model), "types": [type(o).__name__ for o in optimizers], "state dtypes": state_dtypes(optimizers)}
        )
    out["resumed"] = {layout: resumed(world, layout, settings, f"{folder}/{layout}") for layout in layouts}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["resumed at one rank"] = {layout: resumed(1, "fsdp", settings, f"{folder}/{layout}", save=False) for layout in layouts}
    else:
        out["reference"] = reference(settings)
    return out


def resumed(world: int, layout: str, settings: dict, folder: str, save: bool = True) -> dict[str, torch.Tensor]:
    """Steps 0-1 saved at step 2 by torchtitan's CheckpointManager (unless not ``save``: saved
    before, at another world size); then a fresh model and optimizer load it and take step 2."""
    return resumed_from(lambda: trainable(*parallelized(world, layout)), settings, folder, save)


def trainable(model: torch.nn.Module, shard: Shard = WHOLE):
    """``model`` and how its steps run (:func:`train` with ``shard``): what :func:`resumed_from`
    builds."""
    return model, lambda optimizers, steps: train(model, optimizers, steps, shard)


def resumed_from(build: Callable[[], tuple], settings: dict, folder: str, save: bool = True) -> dict[str, torch.Tensor]:
    """:func:`resumed` for what ``build`` makes at each call: a fresh parallelized model (or list of
    model parts) and the function that runs its steps (``run(optimizers, steps)``)."""
    if save:
        model, run = build()
        optimizers = container(model, settings)
        manager, schedulers = checkpointer(folder, model, optimizers)
        for step in range(2):
            run(optimizers, range(step, step + 1))
            schedulers.step()
        assert manager.save(curr_step=2)
        manager.close()
    model, run = build()
    optimizers = container(model, settings)
    manager, _ = checkpointer(folder, model, optimizers)
    assert manager.load(step=2)
    run(optimizers, range(2, STEPS))
    lrs = {group["lr"] for o in optimizers for group in o.param_groups}
    assert lrs == {settings["lr"], settings["adamw_lr"]}, lrs  # the schedule kept the configured lr
    manager.close()
    return full_params(model)


def reference(settings: dict, n_layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """The single-process run: the whole model (of ``n_layers`` layers), Dion3 on the matrices the
    default regex names and torch's AdamW on the rest, with the settings optimizer_config hands each."""
    model = built_model(n_layers=n_layers)
    stepped_whole(model, settings)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def stepped_whole(model: torch.nn.Module, settings: dict):
    """Three steps of the whole ``model`` in one process, ``dion3_megatron.Dion3`` on the matrices
    :data:`~dion3_megatron.torchtitan.HIDDEN_MATRICES` names and torch's AdamW on the rest, built
    without torchtitan's optimizer code with the settings optimizer_config hands each; the Dion3."""
    import re

    from dion3_megatron import Dion3
    from dion3_megatron.torchtitan import HIDDEN_MATRICES

    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if re.search(HIDDEN_MATRICES, n)]
    rest = [p for n, p in named if not re.search(HIDDEN_MATRICES, n)]
    adamw = {"lr": settings["adamw_lr"], "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": settings["weight_decay"]}
    dion3 = Dion3(hidden, **settings)
    optimizers = [dion3, torch.optim.AdamW(rest, **adamw)]
    for tokens in batches():
        loss_of(model(tokens, positions())).backward()
        for o in optimizers:
            o.step()
            o.zero_grad()
    return dion3
