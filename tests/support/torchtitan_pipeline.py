"""torchtitan's pipeline parallelism on CPU: the llama3 model of :mod:`.torchtitan_helpers` split
into stages by torchtitan's own ``pipeline_llm`` (its stage split by module names, one
``PipelineStage`` per stage over the mesh's ``pp`` group, ``parallelize_llama`` applied to every
stage, the schedule of ``torch.distributed.pipelining`` built with ``scale_grads=False``), the
optimizers built by its ``OptimizersContainer`` over the stages (one Dion3 per stage),
stepped as its trainer's ``pp_forward_backward_step`` steps the schedule, checkpoints
through its ``CheckpointManager`` over the stages; compared with the single-process reference of
:mod:`.torchtitan_helpers`.

Besides the three differences from torchtitan's GPU trainer that :mod:`.torchtitan_helpers` names
(SDPA attention, FSDP's summed gradients, the mesh on "cpu", here also the stages' device), two,
none of them in the optimizer:

* the stages are split from a model whose weights are already initialized (the reference's
  weights); torchtitan's trainer splits a model on the meta device and initializes each stage
  after the split, which draws other random numbers;
* the loss is torchtitan's ``MSELoss`` against zero targets, divided by the global count of logits
  given as the trainer gives its ``global_valid_tokens`` (the schedule's ``loss_kwargs``): summed
  over the microbatches (``scale_grads=False``) and the data-parallel ranks it is
  ``torchtitan_helpers.loss_of`` of the global batch, the reference's loss.
"""

from __future__ import annotations

import re
from typing import Any, Callable, ContextManager, NamedTuple

import torch

from . import torchtitan_helpers as helpers

PP = 2  # pipeline-parallel degree; the rest of the world shards (FSDP2)
MICROBATCH = 1  # rows of a microbatch (torchtitan's default pipeline_parallel_microbatch_size)
COUNT = helpers.BATCH * helpers.SEQ * helpers.VOCAB  # the global count of logits the loss divides by

# torchtitan schedule -> (model layers, the ParallelismConfig settings of its stage split). One stage
# per rank takes torchtitan's default split (the embeddings and the output head count as a layer);
# two per rank take one layer each, so that every stage holds hidden matrices (torchtitan's
# OptimizersContainer refuses a param-group pattern that matches nothing in a model part).
ONE_LAYER_PER_STAGE = {
    "pipeline_parallel_layers_per_stage": 1,
    "pipeline_parallel_first_stage_less_layers": 0,
    "pipeline_parallel_last_stage_less_layers": 0,
}
SCHEDULES: dict[str, tuple[int, dict[str, Any]]] = {
    "1F1B": (helpers.LAYERS, {}),
    "Interleaved1F1B": (4, ONE_LAYER_PER_STAGE),
    "ZBVZeroBubble": (4, ONE_LAYER_PER_STAGE),
}
_DIMS: dict[int, object] = {}  # torchtitan's ParallelDims by world size (one mesh per process, as in a trainer)


class Pipeline(NamedTuple):
    """This rank's stages and how its steps run."""

    schedule: Any  # torch.distributed.pipelining's schedule
    parts: list[torch.nn.Module]  # this rank's stages' modules, in the schedule's order
    first: bool  # this rank holds the first stage (it feeds the tokens)
    last: bool  # this rank holds the last stage (it computes the loss)
    context: Callable[[], ContextManager]
    rows: slice  # this rank's rows of the global batch


def pipelined(world: int, schedule: str) -> Pipeline:
    """The model split into stages by torchtitan's ``pipeline_llm`` with ``schedule``, PP ranks deep,
    each stage parallelized by ``parallelize_llama`` over the rest of the world (FSDP2)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import MSELoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.distributed.utils import get_spmd_context
    from torchtitan.models.llama3.parallelize import parallelize_llama

    parallel_dims.device_type = "cpu"
    layers, split = SCHEDULES[schedule]
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=PP, pipeline_parallel_schedule=schedule, pipeline_parallel_microbatch_size=MICROBATCH, **split
    )
    if world not in _DIMS:
        _DIMS[world] = ParallelDims.from_config(parallelism, world)
        _DIMS[world].build_mesh()
    dims = _DIMS[world]
    dp = world // PP
    share = helpers.BATCH // dp
    context = get_spmd_context(parallel_dims=dims)
    model = helpers.built_model(parallelism, layers)
    with context():
        pp_schedule, parts, first, last = pipeline_llm(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32", local_batch_size=share),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
            device=torch.device("cpu"),
            model_config=helpers.model_config(layers),
            parallelize_fn=parallelize_llama,
            loss_fn=MSELoss.Config().build(),
        )
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    dp_rank = torch.distributed.get_rank() % dp  # pp is the mesh's outermost dimension
    return Pipeline(pp_schedule, parts, first, last, context, slice(dp_rank * share, (dp_rank + 1) * share))


def train(pipe: Pipeline, optimizers, steps: range) -> None:
    """torchtitan's pipelined step: the schedule's step over this rank's microbatches (the tokens
    on the first stage's rank, the targets and the losses on the last's, the positions on every
    rank), the optimizers' step, zero_grad."""
    count = {"global_valid_tokens": torch.tensor(COUNT)}
    for tokens in helpers.batches()[steps.start : steps.stop]:
        tokens, positions = tokens[pipe.rows], helpers.positions()[pipe.rows]
        starts = range(0, len(tokens), MICROBATCH)
        with pipe.context():
            pipe.schedule.step(
                arg_mbs=[(tokens[i : i + MICROBATCH],) for i in starts] if pipe.first else None,
                kwarg_mbs=[{"positions": positions[i : i + MICROBATCH]} for i in starts],
                target_mbs=[torch.zeros(MICROBATCH, helpers.SEQ, helpers.VOCAB) for _ in starts] if pipe.last else None,
                losses=[] if pipe.last else None,
                loss_kwargs=count,
                return_outputs=False,
            )
        optimizers.step()
        optimizers.zero_grad()


def _modules(part: torch.nn.Module) -> list[str]:
    """The model's modules a stage holds (``tok_embeddings``, ``layers.0``, ``norm``, ...)."""
    return sorted({".".join(n.split(".")[:2]) if n.startswith("layers.") else n.split(".")[0] for n, _ in part.named_parameters()})


def _case(pipe: Pipeline, optimizers) -> dict:
    from dion3_megatron.torchtitan import HIDDEN_MATRICES

    hidden = [p for part in pipe.parts for n, p in part.named_parameters() if re.search(HIDDEN_MATRICES, n)]
    return {
        "params": helpers.full_params(pipe.parts),
        "stages": [_modules(part) for part in pipe.parts],
        "optimizers": [
            (type(o).__name__, *(sorted(n for g in groups for n in g["param_names"]) for groups in helpers.by_rule(o))) for o in optimizers
        ],
        "hidden": [sorted(n for n, _ in part.named_parameters() if re.search(HIDDEN_MATRICES, n)) for part in pipe.parts],
        "placements": sorted({(str(tuple(p.placements)), p.device_mesh.size()) for p in hidden}),
        "scale_grads": pipe.schedule.scale_grads,
    }


def resumed(world: int, settings: dict, folder: str) -> dict[str, torch.Tensor]:
    """1F1B steps 0-1 saved at step 2 by torchtitan's CheckpointManager over the stages; then fresh
    stages and optimizers load it and take step 2."""

    def build():
        pipe = pipelined(world, "1F1B")
        return pipe.parts, lambda optimizers, steps: train(pipe, optimizers, steps)

    return helpers.resumed_from(build, settings, folder)


def session(rank: int, world: int, settings: dict, folder: str, schedules: list[str]) -> dict:
    """Three steps with each schedule: what each rank's stages and optimizers hold and the
    parameters after them; the 1F1B pipeline also saved after step 2 and resumed by fresh stages
    that take step 2; then rank 0 alone (a world of one, no pipeline: the whole model) resumes that
    checkpoint and takes step 2."""
    import torch.distributed as dist

    out: dict = {"cases": {}}
    for schedule in schedules:
        pipe = pipelined(world, schedule)
        optimizers = helpers.container(pipe.parts, settings)
        train(pipe, optimizers, range(helpers.STEPS))
        out["cases"][schedule] = _case(pipe, optimizers)
    out["resumed"] = resumed(world, settings, folder)
    pipe = pipelined(world, schedules[0])
    optimizers = helpers.container(pipe.parts, settings)
    train(pipe, optimizers, range(1))
    out["poisoned on rank 0"] = helpers.poisoned_step(pipe.parts, optimizers, poison=rank == 0)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["resumed at one rank"] = helpers.resumed(1, "fsdp", settings, folder, save=False)
    return out
