"""The step of the parameters a process holds as torch parameters (the torch optimizer; DeepSpeed
without ZeRO): the matrices of every parameter with a gradient are shards of one engine, whole
(``Sharding.full()``) or, for a DTensor (FSDP2, tensor parallelism), the piece this rank holds
(:mod:`.dtensor`); the other tensors take AdamW. Each parameter's state is a view of the engine's
buffers, in the shapes of what this rank holds, so a state dict reads and writes it as torch's
optimizers do."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Optional

import torch

from .. import options
from ..core.adamw import adamw_step
from ..core.ortho import default_ns_dtype
from ..core.rule import Dion3Hyperparameters
from ..engine import Dion3Engine, MatrixShard, Sharding, cuda_graph as cuda_graph_module, plan
from ..engine.session import EngineSession
from .dtensor import HeldPieces, empty_state, is_dtensor, layout, local, param_shaped, per_matrix, per_row
from .groups import GroupSettings, algorithm_of, check_group, matrix_names, param_names
from .matrices import matrix_count, matrix_shape, matrix_values, matrix_view, stacked_view


class Fractions(dict):
    """The automatic f chosen per parameter, ``{parameter name: f}``: the names of named
    parameters, else ``"group<i>.param<j>"`` (a 3-D parameter's matrices share one f). A parameter
    tensor works as a key too (``fractions[p]``, ``p in fractions``, ``fractions.get(p)``)."""

    def __init__(self, chosen: dict[torch.Tensor, float], names: dict[torch.Tensor, str]) -> None:
        super().__init__((names[p], f) for p, f in chosen.items())
        self._names = names

    def _key(self, key: Any) -> Any:
        """A parameter's name (None for a tensor that is not a parameter); a name as it is."""
        return self._names.get(key) if isinstance(key, torch.Tensor) else key

    def __getitem__(self, key: Any) -> float:
        return super().__getitem__(self._key(key))

    def __contains__(self, key: Any) -> bool:
        return super().__contains__(self._key(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self._key(key), default)


class WholeParameters:
    """One optimizer's whole parameters: the session of their engine (rebuilt when the set with a
    gradient, their storage or their groups' batch settings change, or a checkpoint replaced their
    state), and the groups' settings, resolved where they change."""

    def __init__(self, cuda_graph: bool, front_end: str, offload: bool = False) -> None:
        self.session = EngineSession(cuda_graph, offload=offload)
        self.front_end = front_end
        self.settings = GroupSettings(lambda where, group: check_group(where, group, front_end), options.group_keys(front_end))
        self._shards: dict[torch.Tensor, list[MatrixShard]] = {}  # a stepped matrix parameter -> its matrices
        self._copies: dict[torch.Tensor, torch.Tensor] = {}  # non-contiguous Dion3 weight -> its working copy
        self._pieces = HeldPieces()  # the per-step check of DTensor parameters and their gradients

    def fractions(self, names: dict[torch.Tensor, str]) -> Fractions:
        """The automatic f of each parameter that has one, by name (``names``: every parameter's)."""
        chosen = {
            p: f
            for p, name in names.items()  # (a 3-D parameter: its first matrix's)
            if (f := next((f for m in matrix_names(name, p) if (f := self.session.chosen(m)) is not None), None)) is not None
        }
        return Fractions(chosen, names)

    def group_records(self, groups: list[dict]) -> list[dict[str, float]]:
        """Per param group, the automatic f of its matrices, by matrix name: the record a checkpoint
        keeps in each saved group (:data:`~.lifecycle.RECORD`; ``torch.distributed.checkpoint``
        keeps param groups, and loads each name into the group that holds it)."""
        return self.session.records(len(groups))

    def reset(self, records: list[dict[str, float]]) -> None:
        """After a checkpoint load: the records it held (one per param group); the next step builds
        an engine on the loaded state."""
        self.session.restore(records)

    def agree_speeds(self, groups: list[dict], settings: list[Dion3Hyperparameters]) -> None:
        """The speeds the automatic f is chosen by (:meth:`~dion3_megatron.engine.session.EngineSession.agree_speeds`).

        Under torch.distributed the ranks agree on the device speed of each Newton-Schulz dtype in
        one collective over the world, at the optimizer's first step, whatever a rank holds (a
        pipeline stage may hold only AdamW tensors, or groups of other dtypes than its peers') and
        whether or not its step is then skipped; later choices (a param group added, a matrix's
        first gradient, a checkpoint without them) use what was agreed: no rank ever waits in a
        collective its peers do not make. A group of a dtype none agreed on is refused here.
        """
        self.session.agree_speeds(
            (device, hp.ns_dtype or default_ns_dtype(device))
            for group, hp in zip(groups, settings)
            if plan.chooses_fraction(hp)
            for device in (self.session.compute_device(p.device) for p in group["params"][:1])
        )

    def optimizer_step(
        self, groups: list[dict], state: dict, closure: Optional[Callable[[], float]], gate: Callable[..., bool]
    ) -> Optional[float]:
        """A whole ``torch.optim.Optimizer.step``: the closure, then the step's one decision
        (``gate(check, device, collective=...)``, :meth:`~.lifecycle.Dion3FrontEnd.gate_step`: every
        group's settings where they changed, every gradient, and every DTensor parameter's and
        gradient's placements and pieces checked, the non-finite gate), the speeds agreed (at the
        first step, skipped or not: the ranks agree together), and the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sharded = next((p for group in groups for p in group["params"] if is_dtensor(p)), None)
        settings: list[Dion3Hyperparameters] = []

        def check() -> list[torch.Tensor]:
            grads = []
            settings.clear()
            for gi, group in enumerate(groups):
                settings.append(self.settings.of(f"param group {gi}", group))
                for p in group["params"]:
                    if sharded is not None and is_dtensor(p) and (why := self._pieces.refusal(p, algorithm_of(group, p) == "dion3")):
                        raise ValueError(f"{param_names(groups)[p]}: {why}")
                    if (grad := p.grad) is not None:
                        if grad.is_sparse:
                            raise ValueError(f"param group {gi}: Dion3 does not support sparse gradients")
                        grads.append(local(grad) if sharded is not None else grad)
            return grads

        # Each rank holds its own rows of a DTensor's gradient: the ranks decide together. Whole
        # parameters (one process, or DDP's identical replicas) decide alone.
        device = (
            sharded.device
            if sharded is not None
            else next((p.grad.device for group in groups for p in group["params"] if p.grad is not None), torch.device("cpu"))
        )
        usable = gate(check, device, collective=sharded is not None)
        if not settings:  # (a refused step raised; a skipped one checked every group)
            settings = [self.settings.of(f"param group {gi}", group) for gi, group in enumerate(groups)]
        self.agree_speeds(groups, settings)
        if usable:
            self.step(groups, state, settings)
        return loss

    def step(self, groups: list[dict], state: dict, settings: list[Dion3Hyperparameters]) -> None:
        """One step of every parameter of ``groups`` with a gradient (``state``: the optimizer's,
        by parameter; ``settings``: each group's). Everything that can refuse does so before any
        weight or state changes."""
        matrices: list[tuple[int, torch.Tensor]] = []
        adamw: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # (group, step count, device) -> params
        for gi, group in enumerate(groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if algorithm_of(group, p) == "adamw":
                    own = state.get(p)
                    adamw[gi, int(own["step"].item()) + 1 if own else 1, p.device].append(p)
                else:
                    matrices.append((gi, p))
        engine = self._engine_for(groups, matrices, settings, state)  # may refuse (a dtype with no agreed speed)
        # From here on the step changes state; nothing below refuses anything.
        for (gi, count, _), params in adamw.items():
            group = groups[gi]
            for p in params:
                _adamw_state(state, p)["step"] += 1
            adamw_step(
                [local(p) for p in params],
                [local(_grad_of(p)) for p in params],
                [local(state[p]["exp_avg"]) for p in params],
                [local(state[p]["exp_avg_sq"]) for p in params],
                count,
                group["lr"],
                group["betas"],
                group["eps"],
                group["weight_decay"],
            )
        for gi, p in matrices:  # this step's gradients and schedule (lr, weight decay)
            shards, grad, hp = self._shards[p], local(_grad_of(p)), settings[gi]
            if grad.dim() == 2:  # (one matrix: the gradient itself)
                shards[0].grad, shards[0].hp = grad, hp
                continue
            for shard, matrix_grad in zip(shards, matrix_values(grad).unbind(0)):
                shard.grad, shard.hp = matrix_grad, hp
        copied = [p for _, p in matrices if not p.is_contiguous()]

        def copy_in() -> None:
            for p in copied:
                self._copies[p].copy_(p)

        def copy_back() -> None:
            for p in copied:
                p.copy_(self._copies[p])

        engine.step(
            prologue=copy_in if copied else None, epilogue=copy_back if copied else None, around_key=tuple(p.data_ptr() for p in copied)
        )
        for _, p in matrices:  # the gradients are the caller's: zero_grad() frees them before the next backward
            for shard in self._shards[p]:
                shard.grad = None

    def _engine_for(
        self, groups: list[dict], matrices: list[tuple[int, torch.Tensor]], settings: list[Dion3Hyperparameters], state: dict
    ) -> Dion3Engine:
        # The parameters (by group), their storage and (DTensors) placements: re-placed on the same
        # storage, a DTensor's pieces lie elsewhere in the matrices.
        held = tuple((local(p).data_ptr(), p.placements) for _, p in matrices if is_dtensor(p))
        key = (
            tuple(gi for gi, _ in matrices),
            tuple(map(id, (p for _, p in matrices))),
            tuple(p.data_ptr() for _, p in matrices) if not held else held,
            tuple(cuda_graph_module.baked_settings(hp) for hp in settings),
        )
        if (engine := self.session.current(key)) is not None:
            return engine
        names = param_names(groups)  # (only when the engine is built: names are the matrices' in it)
        sharded = any(is_dtensor(p) for _, p in matrices)
        groups_of = {m: gi for gi, p in matrices for m in matrix_names(names[p], p)}
        engine = self.session.engine_for(
            key,
            lambda: self._matrix_shards(matrices, names, settings, state),
            groups_of=groups_of,
            local=not sharded,
            fresh_grads=True,
            # the build is collective where matrices are split: the ranks gather their choices then
            # (each holds its own experts of a 3-D parameter)
            gather=sharded,
        )
        for gi, p in matrices:  # the parameter's state: views of the engine's buffers
            own = self._shards[p]
            if not own:  # a DTensor of which this rank holds no matrix (no local expert)
                assert is_dtensor(p)
                state[p].update(empty_state(p, settings[gi].momentum_dtype, bool(settings[gi].staleness)))
                continue
            parts = {part: stacked_view([s.state[part] for s in own]) for part in own[0].state}
            parts["momentum"] = parts["momentum"].view(local(p).shape)
            if is_dtensor(p):
                placed = {"momentum": param_shaped, "rounding_step": per_matrix}
                parts = {part: placed.get(part, per_row)(p, v) for part, v in parts.items()}
            if "rounding_step" not in parts:  # (a momentum_dtype changed to fp32)
                state[p].pop("rounding_step", None)
            state[p].update(parts)
        return engine

    def _matrix_shards(
        self, matrices: list[tuple[int, torch.Tensor]], names: dict[torch.Tensor, str], settings: list[Dion3Hyperparameters], state: dict
    ) -> list[MatrixShard]:
        """Every matrix of the parameters with a gradient as an engine shard, with the state the
        optimizer holds for it (stepped before, or loaded)."""
        self._shards = {}
        for gi, p in matrices:
            own = state[p]
            carried: list[dict] = [{} for _ in range(matrix_count(local(p)))]
            if "momentum" in own:  # stepped before (or loaded): the engine copies it in
                rows = [part for part in ("variance", "row_age", "rounding_step") if part in own]  # one per matrix
                carried = [
                    {"momentum": m, **{part: local(own[part])[e] for part in rows}}
                    for e, m in enumerate(matrix_view(local(own["momentum"])))
                ]
            names_of = matrix_names(names[p], p)
            if is_dtensor(p):  # this rank's piece of the logical matrices
                placed = layout(p)
                weight, grad = matrix_view(local(p)), matrix_values(local(_grad_of(p)))
                self._shards[p] = [
                    MatrixShard(
                        names_of[placed.first_matrix + e],
                        weight[e],
                        grad[e],
                        matrix_shape(p),
                        placed.sharding,
                        placed.group,
                        settings[gi],
                        carried[e],
                    )
                    for e in range(matrix_count(local(p)))
                ]
                continue
            weight = matrix_view(self._contiguous_weight(p))
            grad = matrix_values(_grad_of(p))
            self._shards[p] = [
                MatrixShard(name, weight[e], grad[e], matrix_shape(p), Sharding.full(), None, settings[gi], carried[e])
                for e, name in enumerate(names_of)
            ]
        return [s for own in self._shards.values() for s in own]

    def _contiguous_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The weight itself, or for a non-contiguous one (a channels_last conv weight, a transposed
        view) a contiguous buffer that the step fills from it and writes back; the buffer is kept,
        so a CUDA graph of the step finds it at the same address."""
        if p.is_contiguous():
            return p
        if p not in self._copies:
            self._copies[p] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        return self._copies[p]


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    """The gradient of a parameter the step takes (it takes those with one)."""
    assert p.grad is not None
    return p.grad


def _adamw_state(state: dict, p: torch.Tensor) -> dict:
    own = state[p]
    if not own:
        own["step"] = torch.zeros((), dtype=torch.float32)
        own["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        own["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    return own
