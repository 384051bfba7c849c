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

from ..core.adamw import adamw_step
from ..core.ortho import default_ns_dtype
from ..core.rule import Dion3Hyperparameters
from ..engine import Dion3Engine, MatrixShard, Sharding, cuda_graph as cuda_graph_module, fractions, plan
from .dtensor import HeldPieces, choices_held_elsewhere, empty_state, is_dtensor, layout, local, param_shaped, per_row
from .groups import algorithm_of, check_group, hyperparameters, matrix_names, param_names
from .matrices import matrix_count, matrix_shape, matrix_values, matrix_view, stacked_view


class Fractions(dict):
    """The automatic f chosen per parameter, ``{parameter name: f}``: the names of named
    parameters, else ``"group i / param j"`` (a 3-D parameter's matrices share one f). A parameter
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
    """One optimizer's whole parameters: the engine of their matrices (rebuilt when the set with a
    gradient, their storage or their groups' batch settings change, or a checkpoint replaced their
    state), the speeds its replicas agreed, and the record of the automatic f chosen."""

    def __init__(self, cuda_graph: bool) -> None:
        self.cuda_graph = cuda_graph
        self.chosen: dict[str, float] = {}  # the automatic f chosen, by matrix name (the checkpoint's record)
        self._speeds: Optional[fractions.AgreedSpeeds] = None  # the speeds the ranks agreed (None: not yet)
        self.engine: Optional[Dion3Engine] = None
        self._engine_key: Optional[tuple] = None
        self._shards: dict[torch.Tensor, list[MatrixShard]] = {}  # a stepped matrix parameter -> its matrices
        self._copies: dict[torch.Tensor, torch.Tensor] = {}  # non-contiguous Dion3 weight -> its working copy
        self._pieces = HeldPieces()  # the per-step check of DTensor parameters and their gradients

    def fractions(self, names: dict[torch.Tensor, str]) -> Fractions:
        """The automatic f of each parameter that has one, by name (``names``: every parameter's)."""
        chosen = {
            p: f
            for p, name in names.items()  # (a 3-D parameter: its first matrix's)
            if (f := next((self.chosen[m] for m in matrix_names(name, p) if m in self.chosen), None)) is not None
        }
        return Fractions(chosen, names)

    def group_records(self, groups: list[dict]) -> list[dict[str, float]]:
        """Per param group, the automatic f its matrices use here, by matrix name: the record a
        checkpoint keeps in each saved group (:data:`~.lifecycle.RECORD`; ``torch.distributed.checkpoint``
        keeps param groups, and loads each name into the group that holds it)."""
        names = param_names(groups)
        return [{m: self.chosen[m] for p in group["params"] for m in matrix_names(names[p], p) if m in self.chosen} for group in groups]

    def reset(self, records: list[dict[str, float]]) -> None:
        """After a checkpoint load: the records it held (one per param group); the next step builds
        an engine on the loaded state."""
        self.chosen, self.engine = {name: f for record in records for name, f in record.items()}, None

    def agree_speeds(self, groups: list[dict]) -> None:
        """The speeds the automatic f is chosen by (:class:`~dion3_megatron.engine.fractions.AgreedSpeeds`).

        Under torch.distributed the ranks agree on the device speed of each Newton-Schulz dtype in
        one collective over the world, at the optimizer's first step, whatever a rank holds (a
        pipeline stage may hold only AdamW tensors, or groups of other dtypes than its peers') and
        whether or not its step is then skipped; later choices (a param group added, a matrix's
        first gradient, a checkpoint without them) use what was agreed: no rank ever waits in a
        collective its peers do not make. A group of a dtype none agreed on is refused here.
        """
        wanted = [
            (p.device, hyperparameters(group).ns_dtype or default_ns_dtype(p.device))
            for group in groups
            if plan.chooses_fraction(hyperparameters(group))
            for p in group["params"][:1]
        ]
        if self._speeds is None:
            self._speeds = fractions.agreed_speeds(wanted)
        for device, dtype in wanted:
            self._speeds.of(device, dtype)

    def optimizer_step(
        self, groups: list[dict], state: dict, front_end: str, closure: Optional[Callable[[], float]], gate: Callable[..., bool]
    ) -> Optional[float]:
        """A whole ``torch.optim.Optimizer.step``: the closure, then the step's one decision
        (``gate(check, device, collective=...)``, :meth:`~.lifecycle.Dion3FrontEnd.gate_step`: every
        group's settings, every gradient, and every DTensor parameter's and gradient's placements and
        pieces checked, the non-finite gate), the speeds agreed (at the first step, skipped or not:
        the ranks agree together), and the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sharded = next((p for group in groups for p in group["params"] if is_dtensor(p)), None)

        def check() -> list[torch.Tensor]:
            grads = []
            for gi, group in enumerate(groups):
                check_group(f"param group {gi}", group, front_end)
                for p in group["params"]:
                    if is_dtensor(p) and (why := self._pieces.refusal(p, algorithm_of(group, p) == "dion3")):
                        raise ValueError(f"{param_names(groups)[p]}: {why}")
                    if is_dtensor(p) and algorithm_of(group, p) == "dion3" and hyperparameters(group).momentum_dtype != torch.float32:
                        raise ValueError(
                            f"{param_names(groups)[p]}: momentum_dtype={group['momentum_dtype']!r} is taken for whole "
                            "parameters; a DTensor parameter's momentum (FSDP2, tensor parallelism) is fp32: set "
                            f"momentum_dtype='fp32' in param group {gi}"
                        )
                    if p.grad is not None:
                        if p.grad.is_sparse:
                            raise ValueError(f"param group {gi}: Dion3 does not support sparse gradients")
                        grads.append(local(p.grad))
            return grads

        # Each rank holds its own rows of a DTensor's gradient: the ranks decide together. Whole
        # parameters (one process, or DDP's identical replicas) decide alone.
        device = (
            sharded.device
            if sharded is not None
            else next((p.grad.device for group in groups for p in group["params"] if p.grad is not None), torch.device("cpu"))
        )
        usable = gate(check, device, collective=sharded is not None)
        self.agree_speeds(groups)
        if usable:
            self.step(groups, state)
        return loss

    def step(self, groups: list[dict], state: dict) -> None:
        """One step of every parameter of ``groups`` with a gradient (``state``: the optimizer's,
        by parameter). Everything that can refuse does so before any weight or state changes."""
        settings = [hyperparameters(group) for group in groups]
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
            grads = matrix_values(local(_grad_of(p))).unbind(0)
            for shard, grad in zip(self._shards[p], grads):
                shard.grad, shard.hp = grad, settings[gi]
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

    def _engine_for(
        self, groups: list[dict], matrices: list[tuple[int, torch.Tensor]], settings: list[Dion3Hyperparameters], state: dict
    ) -> Dion3Engine:
        # (a DTensor's placements: re-placed on the same storage, its pieces lie elsewhere in the matrices)
        key = (
            tuple((gi, id(p), local(p).data_ptr(), p.placements if is_dtensor(p) else None) for gi, p in matrices),
            tuple(cuda_graph_module.baked_settings(hp) for hp in settings),
        )
        if self.engine is not None and key == self._engine_key:
            return self.engine
        names = param_names(groups)  # (only when the engine is built: names are the matrices' in it)
        shards: dict[torch.Tensor, list[MatrixShard]] = {}
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
                shards[p] = [
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
            shards[p] = [
                MatrixShard(name, weight[e], grad[e], matrix_shape(p), Sharding.full(), None, settings[gi], carried[e])
                for e, name in enumerate(names_of)
            ]
        # Construction is collective where a matrix is split (every rank steps every FSDP2 parameter).
        engine = Dion3Engine(
            [s for own in shards.values() for s in own],
            cuda_graph=self.cuda_graph,
            local=not any(is_dtensor(p) for p in shards),
            fresh_grads=True,
            speeds=self._speeds,
            chosen=self.chosen,
        )
        chosen_here = engine.chosen_fractions()
        experts = [
            (p, matrix_names(names[p], p)) for gi, p in matrices if is_dtensor(p) and p.dim() == 3 and plan.chooses_fraction(settings[gi])
        ]
        self.chosen.update({**choices_held_elsewhere(experts, chosen_here), **chosen_here})
        for gi, p in matrices:  # the parameter's state: views of the engine's buffers
            own = shards[p]
            if not own:  # a DTensor of which this rank holds no matrix (no local expert)
                assert is_dtensor(p)
                state[p].update(empty_state(p, ["variance"] + ["row_age"] * bool(settings[gi].staleness)))
                continue
            parts = {part: stacked_view([s.state[part] for s in own]) for part in own[0].state}
            parts["momentum"] = parts["momentum"].view(local(p).shape)
            if is_dtensor(p):
                parts = {part: param_shaped(p, v) if part == "momentum" else per_row(p, v) for part, v in parts.items()}
            if "rounding_step" not in parts:  # (a momentum_dtype changed to fp32)
                state[p].pop("rounding_step", None)
            state[p].update(parts)
        self.engine, self._engine_key, self._shards = engine, key, shards
        return engine

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
