"""Dion3 as a Megatron-Core emerging optimizer: the torch optimizer Megatron wraps.

Megatron hands this optimizer the param groups of the 2-D hidden matrices only (its
``default_param_overrides`` route embeddings, the output layer, norms and biases to Adam). Under
``--use-distributed-optimizer`` the :class:`LayerWiseDistributedOptimizer` narrows those groups to
the whole (tensor-parallel-local) matrices this data-parallel rank owns (ZeRO-1, state only on
owners) and wraps this optimizer for bf16 (fp32 main params).

Every parameter is described once (:class:`~.layout.ParamLayout`): which logical matrices it holds
and how they are split over tensor parallelism. Each logical matrix becomes one
:class:`~dion3_megatron.engine.MatrixShard`; the megabatch engine does the whole Dion3 step,
orthogonalizing whole logical matrices across the tensor-parallel group, never per-shard blocks.

State layout (documented choice). Per logical matrix the engine keeps ``momentum`` (the local
piece's shape, in ``momentum_dtype``: fp32, or bf16 with stochastic rounding and a count of steps),
``variance`` (fp32, one value per row the piece touches) and, with staleness, ``row_age`` (fp32,
the same rows: steps since each was applied) in its per-shape buffers. A parameter's logical
matrices are contiguous row ranges of its *working layout*: its local rows reordered so each
logical matrix's rows are contiguous. That is the identity for every parameter
but a fused QKV weight, whose Q, K and V rows are gathered out of the per-group interleaving
([q.. k v] per group) into [Q; K; V]; the QKV weight and gradient are copied into that layout each
step and the weight written back, the state never moves. ``state_dict()`` assembles each
parameter's state in the parameter's own layout and stores ``variance`` (and ``row_age``)
broadcast over the columns (param-shaped): Megatron's torch_dist checkpoint shards every state
tensor like its parameter, so checkpoints reshard across tensor- and data-parallel sizes like Adam's.
Under torch FSDP2 a parameter is a DTensor whose rows the data-parallel group splits: its rows are a
piece of the whole (:func:`~.layout.fsdp_piece`), each logical matrix row-sharded over that group,
and the state dict holds DTensors placed like it (torch_dcp saves and reshards them). A bf16
momentum's count of steps is the optimizer's, saved in the param groups (:mod:`.saved_state`).
"""

from __future__ import annotations

from typing import Any, Never, Optional

import torch
import torch.distributed as dist

from .. import options
from ..kernels import config as kernel_config
from ..frontend import groups as grouping
from ..frontend.lifecycle import Dion3FrontEnd, without_records
from ..core.ortho import default_ns_dtype
from ..engine import Dion3Engine, MatrixShard, Sharding, plan
from ..engine.session import EngineSession
from ..core.rule import Dion3Hyperparameters
from ..frontend.dtensor import is_dtensor, local, param_shaped
from . import saved_state
from .layout import ParamLayout, describe_model, describe_param, fsdp_piece
from .saved_state import ROUNDING_STEP, Entry


def decision_device(fallback: torch.device) -> torch.device:
    """Where the step's decision is agreed: the current GPU under NCCL (a rank without
    parameters of its own joins too), else ``fallback``."""
    if dist.is_initialized() and torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


# The Dion3 settings a param group carries (Megatron's groups add their own keys beside them):
# Megatron's lr and weight decay, and the per-group options.
_GROUP_SETTINGS = ("lr", "weight_decay", *options.group_keys(options.MEGATRON))

# The engine's parameters (their ids) and each param group's staleness and momentum dtype.
_EngineKey = tuple[tuple[int, ...], tuple[Any, ...]]


class MegatronDion3(Dion3FrontEnd):
    """Dion3 for the 2-D hidden matrices of a Megatron-Core model (any TP / PP / EP / DP).

    - ``params``: Megatron's param groups (``lr`` and ``weight_decay`` set by its lr scheduler);
    - ``lr``, ``weight_decay``: defaults for groups that lack them;
    - ``model_chunks``: the model, to read parameter names and marks (main fp32 params of the bf16
      wrapper are matched to their model params through Megatron's ``param.main_param``);
    - ``pg_collection``: Megatron's process groups (``tp``, ``expt_tp``);
    - ``layouts``: parameter -> `ParamLayout`, instead of describing ``model_chunks``.
    - ``offload``: keep the Dion3 state in pinned host memory and stream it through the GPU at each
      step (``dion3_megatron.engine.offload``): Megatron's ``--optimizer-cpu-offload``.

    The other arguments are the options (keyword only; [docs/configuration.md](../configuration.md)
    describes each): `dion3_megatron.megatron.registry.config_to_kwargs` reads them from
    ``OptimizerConfig.dion3_<name>``.
    """

    FRONT_END = options.MEGATRON

    def __init__(
        self,
        params: Any,
        lr: float = 0.01,
        weight_decay: float = 0.01,
        model_chunks: Optional[list] = None,
        pg_collection: Any = None,
        layouts: Optional[dict] = None,
        offload: bool = False,
        *,
        fraction: float | str = "auto",
        mu: Optional[float] = None,
        beta2: float = 0.95,
        eps: float = 1e-8,
        adjust_lr: str = "spectral_norm",
        scale_lr_by_fraction: bool = True,
        scale_mu_by_fraction: bool = False,
        staleness: float = 1.0,
        ns_method: str = "gram",
        momentum_dtype: torch.dtype | str = "fp32",
        kernels: Optional[str] = None,
        cuda_graph: bool = True,
        split_qkv: bool = True,
        split_glu: bool = True,
        **unknown: Never,
    ) -> None:
        where = type(self).__name__
        options.refuse_unknown(where, options.MEGATRON, unknown)
        settings = options.settings(where, options.MEGATRON, options.from_signature(options.MEGATRON, locals()))
        options.check(where, lr=lr, weight_decay=weight_decay, offload=offload)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, **{k: settings[k] for k in options.group_keys(options.MEGATRON)}))
        self.cuda_graph = settings["cuda_graph"]
        self.split_qkv = settings["split_qkv"]
        self.split_glu = settings["split_glu"]
        self.kernels = settings["kernels"]
        self.pg_collection = pg_collection
        self._model_chunks = list(model_chunks) if model_chunks is not None else []
        self._layouts: dict[torch.Tensor, ParamLayout] = dict(layouts) if layouts else {}
        if model_chunks is not None and not layouts:
            self._layouts = describe_model(model_chunks, pg_collection, split_qkv=self.split_qkv, split_glu=self.split_glu)
        self._layouts = {q: fsdp_piece(q, layout) if is_dtensor(q) else layout for q, layout in self._layouts.items()}
        # The model's Dion3 matrices (2-D, not embedding or output), against which the automatic f
        # weighs the share this optimizer steps (0: no model given).
        self._model_matrix_numel = (
            sum(q.numel() for q in self._layouts if not getattr(q, "is_embedding_or_output_parameter", False)) if model_chunks else 0
        )
        self.offload = offload
        # its engine built at the first step or state access, on every rank
        self._session = EngineSession(self.cuda_graph, offload=offload)
        self._settings = grouping.GroupSettings(
            lambda where, group: options.check(where, **{k: group[k] for k in _GROUP_SETTINGS}), _GROUP_SETTINGS
        )
        self._pending: list[Entry] = []  # loaded, set at the next engine build
        self._rounding_step = 0  # steps taken: every bf16 momentum's count (ROUNDING_STEP)
        self._finite_vouched = False
        self._shards: dict[torch.Tensor, list] = {}
        self._work: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stamps: dict[torch.Tensor, tuple] = {}  # per param: what its shards' views were cut from
        self._refresh_plan: list = []  # per group: (index, group, params used in place, all its shards)
        self._permuted: list = []  # (param, perm, weight buffer, grad buffer) of the row-permuted params

    # -------------------------------------------------------------------------------------------
    # Parameter descriptions (main params of the bf16 wrapper map back to model params).

    def layout_of(self, p: torch.Tensor) -> ParamLayout:
        layout = self._layouts.get(p)
        if layout is not None:
            return layout
        for model_param, model_layout in list(self._layouts.items()):
            main = getattr(model_param, "main_param", None)
            if main is not None and main not in self._layouts:
                self._layouts[main] = model_layout
        layout = self._layouts.get(p)
        if layout is None:  # no model given (plain use): one whole matrix, named by its place
            gi, j = next((gi, j) for gi, group in enumerate(self.param_groups) for j, q in enumerate(group["params"]) if q is p)
            layout = describe_param(grouping.param_name(gi, j), p)
            layout = fsdp_piece(p, layout) if is_dtensor(p) else layout
            self._layouts[p] = layout
        return layout

    def _hp(self, gi: int, group: dict) -> Dion3Hyperparameters:
        return self._settings.of(f"param group {gi}", group)

    # -------------------------------------------------------------------------------------------
    # Shards and engine.

    def _working(self, p: torch.Tensor, layout: ParamLayout, with_grad: bool):
        """Weight and grad in the working layout: the tensors themselves, or for a row-permuted
        parameter two fixed buffers that the step's prologue fills (:meth:`_permuted_copies`)."""
        if layout.perm is not None:
            buffers = self._work.get(p)
            if buffers is None:
                assert layout.inv_perm is not None  # set with perm (describe_param)
                layout.perm = layout.perm.to(p.device)
                layout.inv_perm = layout.inv_perm.to(p.device)
                shape = layout.local_shape
                buffers = (torch.empty(shape, dtype=p.dtype, device=p.device), torch.empty(shape, dtype=torch.float32, device=p.device))
                self._work[p] = buffers
            return buffers
        grad = local(p.grad) if with_grad and p.grad is not None else None
        if with_grad and grad is None:
            grad = torch.zeros(layout.local_shape, dtype=p.dtype, device=p.device)
        return local(p.data), grad

    def _permuted_copies(self):
        """(prologue, epilogue, key) of the step: gather each row-permuted parameter's weight and
        gradient into its working buffers before the step, scatter the weight back after it. The
        key names the parameters' and gradients' storage (part of a CUDA graph's key)."""
        permuted = self._permuted
        if not permuted:
            return None, None, ()
        grads = [None if p.grad is None else local(p.grad) for p, *_ in permuted]
        key = tuple((local(p.data).data_ptr(), None if g is None else (g.data_ptr(), g.dtype)) for (p, *_), g in zip(permuted, grads))

        def prologue() -> None:
            for (p, perm, weight, grad_buffer), grad in zip(permuted, grads):
                torch.index_select(local(p.data), 0, perm, out=weight)
                if grad is None:
                    grad_buffer.zero_()
                elif grad.dtype == torch.float32:
                    torch.index_select(grad, 0, perm, out=grad_buffer)
                else:
                    grad_buffer.copy_(grad.index_select(0, perm))

        def epilogue() -> None:
            for p, perm, weight, _ in permuted:
                local(p.data).index_copy_(0, perm, weight)

        return prologue, epilogue, key

    def _params(self) -> list[tuple[torch.Tensor, dict]]:
        return [(p, group) for group in self.param_groups for p in group["params"]]

    def _step_share(self, params: list[tuple[torch.Tensor, dict]]) -> float:
        """The share of the model's Dion3 matrices this optimizer steps: about 1 / DP under
        Megatron's layer-wise ZeRO-1, where each rank steps its layers' matrices and computes the
        forward and backward of all (1 without the model chunks to compare with)."""
        own = sum(local(p).numel() for p, _ in params)
        return min(1.0, own / self._model_matrix_numel) if self._model_matrix_numel and own else 1.0

    def _ensure_engine(self, with_grads: bool) -> Dion3Engine:
        """The engine (built at the first call, again where the parameters or a group's staleness
        changed, through the session), its shards refreshed for this step.

        Building is collective (the engine checks its plan against the other ranks): every rank
        builds at the same call, the first step or the first state access (checkpointing).
        """
        params = self._params()
        # The engine plans with the staleness (its rows' ages exist only when it is > 0) and the
        # momentum's dtype: a change builds the engine anew, carrying the state over (ages switched
        # on start at 0, a momentum converted).
        key: _EngineKey = (tuple(id(p) for p, _ in params), tuple((g["staleness"], g["momentum_dtype"]) for g in self.param_groups))
        engine = self._session.current(key)
        if engine is not None:
            self._refresh_shards(with_grads)
            return engine
        group_hp = {id(group): self._hp(gi, group) for gi, group in enumerate(self.param_groups)}
        # One collective, at the first build (collective on every rank anyway): replicas of a whole
        # matrix (data parallelism without the distributed optimizer) choose one f.
        self._session.agree_speeds(
            (p.device, hp.ns_dtype or default_ns_dtype(p.device)) for p, group in params if plan.chooses_fraction(hp := group_hp[id(group)])
        )
        group_index = {id(group): gi for gi, group in enumerate(self.param_groups)}
        engine = self._session.engine_for(
            key,
            lambda: self._matrix_shards(params, group_hp, with_grads),
            groups_of={self._matrix_name(p, m): group_index[id(g)] for p, g in params for m in self.layout_of(p).matrices},
            step_share=self._step_share(params),
            gather=True,  # each rank holds its own matrices (layer-wise ZeRO-1, pipeline stages)
        )
        # What changes from step to step: each group's lr and weight decay, and the gradient (and,
        # rarely, weight) storage of the parameters used in place (the permuted ones use buffers).
        self._refresh_plan = [
            (
                gi,
                group,
                [(p, self._shards[p], self.layout_of(p).matrices) for p in group["params"] if p not in self._work],
                [s for p in group["params"] for s in self._shards[p]],
            )
            for gi, group in enumerate(self.param_groups)
        ]
        self._permuted = [(p, self.layout_of(p).perm, *self._work[p]) for p, _ in params if p in self._work]
        pending, self._pending = self._pending, []
        self._set_state(pending)
        for shards in self._shards.values():  # every bf16 momentum at the optimizer's count
            for shard in shards:
                if ROUNDING_STEP in shard.state:
                    shard.state[ROUNDING_STEP].fill_(self._rounding_step)
        return engine

    def _matrix_name(self, p: torch.Tensor, matrix: Any) -> str:
        layout = self.layout_of(p)
        return layout.name + (f".{matrix.suffix}" if matrix.suffix else "")

    def _matrix_shards(self, params: list[tuple[torch.Tensor, dict]], group_hp: dict, with_grads: bool) -> list[MatrixShard]:
        """Every logical matrix of every parameter as an engine shard: whole, row blocks or column
        blocks over the tensor-parallel group, or row pieces over the data-parallel group (FSDP2)."""
        self._shards = {}
        self._stamps.clear()
        for p, group in params:
            layout = self.layout_of(p)
            weight, grad = self._working(p, layout, with_grads)
            shards = []
            for matrix in layout.matrices:
                rows = slice(matrix.start, matrix.stop)
                if layout.partition is None:
                    sharding, group_arg = Sharding.full(), None
                elif layout.partition == "data":
                    sharding, group_arg = Sharding.rows(matrix.bounds), layout.group
                elif layout.partition == "rows":
                    sharding, group_arg = Sharding.even_rows(matrix.full_shape[0], layout.group_size), layout.group
                else:
                    sharding, group_arg = Sharding.even_cols(matrix.full_shape[1], layout.group_size), layout.group
                shards.append(
                    MatrixShard(
                        name=self._matrix_name(p, matrix),
                        weight=weight[rows],
                        grad=grad[rows] if grad is not None else None,
                        shape=matrix.full_shape,
                        sharding=sharding,
                        group=group_arg,
                        hp=group_hp[id(group)],
                        state={},
                    )
                )
            self._shards[p] = shards
        return [s for p, _ in params for s in self._shards[p]]

    def _refresh_shards(self, with_grads: bool) -> None:
        """Per step: the schedule's lr and weight decay into every shard (for a step: ``with_grads``),
        and new gradient (or weight) storage into the shards' views. Runs on every step, hence the
        flat plan."""
        for gi, group, in_place, group_shards in self._refresh_plan:
            hp = self._hp(gi, group) if with_grads else None
            if hp is not None and group_shards and group_shards[0].hp is not hp:  # (a new object only where a value changed)
                for shard in group_shards:
                    shard.hp = hp
            for p, shards, matrices in in_place:
                grad = local(p.grad) if with_grads and p.grad is not None else None
                stamp = (local(p.data).data_ptr(), None if grad is None else grad.data_ptr())
                if self._stamps.get(p) == stamp:
                    continue
                weight, grad = self._working(p, self.layout_of(p), with_grads)
                self._stamps[p] = (weight.data_ptr(), None if grad is None else grad.data_ptr())
                for shard, matrix in zip(shards, matrices):
                    shard.weight = weight[matrix.start : matrix.stop]
                    shard.grad = grad[matrix.start : matrix.stop] if grad is not None else None

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state of every parameter (Megatron needs it before loading a checkpoint)."""
        self._ensure_engine(with_grads=False)

    # -------------------------------------------------------------------------------------------
    # Checkpoint state: each parameter's own layout, ``variance`` broadcast to the parameter's shape.

    def _param_state(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(momentum, variance) of a parameter in its own layout, and its rows' ages when its
        engine keeps them (staleness)."""
        layout = self.layout_of(p)
        shards = self._shards[p]
        keys = ("momentum", "variance", "row_age") if "row_age" in shards[0].state else ("momentum", "variance")
        out = [torch.cat([s.state[key] for s in shards]) if len(shards) > 1 else shards[0].state[key] for key in keys]
        if layout.inv_perm is not None:
            out = [t.index_select(0, layout.inv_perm.to(t.device)) for t in out]
        return (out[0].reshape(layout.local_shape), *out[1:])

    def _saved_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """A parameter's entry of the state dict: its momentum, its row variances and (with
        staleness) row ages, param-shaped (copies)."""
        momentum, *rows = self._param_state(p)
        entry = saved_state.entry_of(momentum, rows)
        return {key: param_shaped(p, t) for key, t in entry.items()} if is_dtensor(p) else entry

    def fractions_of(self, p: torch.Tensor) -> list[tuple[tuple[int, int], float | str]]:
        """(full shape, f) of each logical matrix of ``p`` as its steps use them: the group's f, or
        the automatic f chosen. Empty before the first step (or checkpoint access) builds the
        engine."""
        return [(tuple(s.shape), f if (f := self._session.chosen(s.name)) is not None else s.hp.fraction) for s in self._shards.get(p, [])]

    def state_dict(self) -> dict[str, Any]:
        """Each parameter's state in its own layout (param-shaped, the momentum in its dtype),
        ``skipped_steps``, under each param group's ``"fractions"`` the automatic f of its matrices
        on every rank (the same on every rank), and in each group of a bf16 momentum the count of
        steps its rounding hashes (``rounding_step``)."""
        self._ensure_engine(with_grads=False)
        sd = super().state_dict()  # param_groups packed with indices; self.state stays empty
        sd["state"] = {index: self._saved_state(p) for index, (p, _) in enumerate(self._params())}
        for saved, group in zip(sd["param_groups"], self.param_groups):
            if options.momentum_dtype(group["momentum_dtype"]) != torch.float32:
                saved[ROUNDING_STEP] = self._rounding_step
        return sd

    def fraction_records(self) -> list[dict[str, float]]:
        """Per param group, the automatic f of its matrices on every rank (gathered at each build:
        every rank saves the same record, so the one Megatron's torch_dist checkpoint keeps, the
        param groups of one rank, names every matrix)."""
        self._ensure_engine(with_grads=False)
        return self._session.records(len(self.param_groups))

    def restore_fraction_records(self, records: list[dict[str, float]]) -> None:
        """The saved f of every matrix named in any group's record, for the engine built next, so
        a resume, at any data-parallel size, does not measure the device again."""
        self._session.restore(records)

    def _loaded_entries(self, state_dict: dict[str, Any]) -> list[Entry]:
        return saved_state.loaded_entries(self.param_groups, state_dict, _GROUP_SETTINGS)

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        self._loaded_entries(state_dict)
        saved_state.loaded_rounding_step(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Everything checked, then everything set (``Dion3FrontEnd``); the engine is then
        built anew (collectively: every rank loads the same checkpoint) with the checkpoint's
        staleness and f, and takes the loaded state."""
        super().load_state_dict(state_dict)
        self._ensure_engine(with_grads=False)

    def load_checked(self, state_dict: dict[str, Any]) -> None:
        """The groups take the checkpoint's settings; the engine built next takes the loaded state
        (the parameters the checkpoint holds none for keep theirs)."""
        loaded = self._loaded_entries(state_dict)
        kept: list[Entry] = []
        if self._session.engine is not None:
            ids = {id(p) for p, _ in loaded}
            kept = [(p, self._saved_state(p)) for p, _ in self._params() if id(p) not in ids]
        saved_groups = without_records(state_dict["param_groups"])
        grouping.announce_conversions(saved_state.conversions(self.param_groups, saved_groups, loaded), stacklevel=4)
        for mine, saved in zip(self.param_groups, saved_groups):
            mine.update({k: v for k, v in saved.items() if k not in grouping.KEPT_ON_LOAD and k in mine})
        self._rounding_step = saved_state.loaded_rounding_step(state_dict)
        self._pending = kept + loaded  # (the session builds a new engine: restore_fraction_records)

    def _set_state(self, entries: list[Entry]) -> None:
        """Copy (param, state dict entry) pairs into the engine's state. An engine with row ages
        (staleness) takes the entry's, or 0 for an entry without them (a fresh run's ages)."""
        for p, entry in entries:
            layout = self.layout_of(p)
            state = {"momentum": local(entry["momentum"].detach()), "variance": local(entry["variance"].detach())[:, 0]}
            if "row_age" in self._shards[p][0].state:
                state["row_age"] = local(entry["row_age"].detach())[:, 0] if "row_age" in entry else torch.zeros(layout.local_shape[0])
            for key, value in state.items():
                value = value.to(device=p.device, dtype=self._shards[p][0].state[key].dtype)
                if layout.perm is not None:
                    value = value.index_select(0, layout.perm.to(p.device))
                for shard, matrix in zip(self._shards[p], layout.matrices):
                    shard.state[key].copy_(value[matrix.start : matrix.stop])

    # -------------------------------------------------------------------------------------------
    # The step.

    def step_check(self) -> list[torch.Tensor]:
        """This step's checks, run before anything changes (every step: a setting or a gradient
        may change between steps): every group's settings, every gradient dense; ValueError
        naming the group and the parameter. Returns the gradients for the non-finite gate."""
        grads = []
        for gi, group in enumerate(self.param_groups):
            self._hp(gi, group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"param group {gi}: {self.layout_of(p).name}: Dion3 does not support sparse gradients")
                grads.append(local(p.grad))
        return grads

    def _device(self) -> torch.device:
        return decision_device(next((p.device for p, _ in self._params()), torch.device("cpu")))

    def vouch_finite(self, finite: bool) -> None:
        """Set by a Megatron wrapper before each step (see ``dion3_megatron.megatron.wrappers``): True
        when its decision (this optimizer's [`step_check`][dion3_megatron.megatron.MegatronDion3.step_check]
        included) let the coming step go ahead on every rank, so the step takes no decision of its
        own. The next step consumes it."""
        self._finite_vouched = finite

    @torch.no_grad()
    @kernel_config.scoped_step
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        vouched, self._finite_vouched = self._finite_vouched, False
        # The step's one decision, agreed by every rank (a rank that skipped alone would leave the
        # engine's collectives unmatched).
        if not vouched and not self.gate_step(self.step_check, self._device()):
            return loss
        engine = self._ensure_engine(with_grads=True)
        prologue, epilogue, key = self._permuted_copies()
        engine.step(prologue, epilogue, key)
        self._rounding_step += 1
        return loss
