"""Dion3 as a ``torch.optim.Optimizer`` for one process (or DDP, where every rank steps alike).

Matrices (>= 2-D) take the Dion3 rule, everything else AdamW, unless a param group says
``algorithm="dion3"`` or ``algorithm="adamw"``. A 3-D tensor is a batch of matrices (MoE experts);
4-D and larger (conv weights) flatten to (out, rest). The selected rows of every matrix whose
selected block has the same shape are orthogonalized as one batch: the matrices are whole
(``Sharding.full()``) shards of the megabatch engine (:mod:`dion3_megatron.engine`), which also
chooses the automatic f (:mod:`dion3_megatron.engine.plan`). The math itself lives in :mod:`dion3_megatron.core.rule`.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from . import options
from .core import rule
from .core.ortho import default_ns_dtype
from .core.rule import Dion3Hyperparameters
from .engine import Dion3Engine, MatrixShard, Sharding, cuda_graph as cuda_graph_module, fractions, plan
from .frontend import (announce_skipped_step, gradients_usable, matrix_count, matrix_shape, matrix_values, matrix_view,
                       stacked_view)
from .kernels import config as kernel_config

ALGORITHMS = ("dion3", "adamw")


class Fractions(dict):
    """The automatic f chosen per parameter, ``{parameter name: f}``: the names of named parameters, else
    ``"group i / param j"`` (a 3-D parameter's matrices share one f). A parameter tensor works as a
    key too (``fractions[p]``, ``p in fractions``, ``fractions.get(p)``)."""

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


@options.documented(options.TORCH)
class Dion3(torch.optim.Optimizer):
    """Dion3: top-fraction row selection, Gram Newton-Schulz, NorMuon normalization, error feedback.

    Args:
        params: parameters (or ``named_parameters()``) or param groups. A group may set
            ``algorithm`` ("dion3" | "adamw") and any option below but ``kernels`` and
            ``cuda_graph``; ``fraction`` and ``num_heads`` may differ per group.
        **settings: the options below (keyword only; declared in :mod:`dion3_megatron.options`).

    The automatic fraction is chosen per matrix at its first step by :mod:`dion3_megatron.engine.plan` from its
    shape and this device's measured speed (see :attr:`fractions`). Under torch.distributed every
    rank must step that first step together (as DDP does): all take the slowest rank's speed and
    agree. ``cuda_graph``: on one CUDA device the Dion3 part of the step (after the momentum
    accumulation) is captured once the same matrices have stepped twice, and replayed: one launch
    instead of hundreds. Bit-identical to the eager step; it keeps the step's temporaries
    allocated. Any change of members, settings other than lr and weight decay, or tensor storage
    captures anew.

    A step with a non-finite gradient anywhere changes nothing, warns, and counts in
    :attr:`skipped_steps`. A step that raises (a setting changed to an invalid value since
    construction, a sparse gradient) raises before any weight, state or counter changes.

    Options:
{options}
    """

    def __init__(self, params: Iterable[Any], **settings: Any) -> None:
        settings = options.settings(type(self).__name__, options.TORCH, settings)
        groups = options.group_keys(options.TORCH)
        # The optimizer-wide options, checked here; the per-group ones with each group.
        options.check(type(self).__name__, **{k: v for k, v in settings.items() if k not in groups})
        self.cuda_graph: bool = settings["cuda_graph"]
        self.kernels: Optional[str] = settings["kernels"]
        self.adamw_lr: float = settings["adamw_lr"]
        self.skipped_steps = 0
        self._chosen: dict[str, float] = {}  # the automatic f chosen, by matrix name (the checkpoint's record)
        self._speeds: Optional[fractions.AgreedSpeeds] = None  # the speeds the ranks agreed (None: not yet)
        self._engine: Optional[Dion3Engine] = None
        self._engine_key: Optional[tuple] = None
        self._shards: dict[torch.Tensor, list[MatrixShard]] = {}  # a stepped matrix parameter -> its matrices
        self._copies: dict[torch.Tensor, torch.Tensor] = {}  # non-contiguous Dion3 weight -> its working copy
        params = list(params)
        self._split_from_plain_list = bool(params) and not isinstance(params[0], dict)
        if self._split_from_plain_list:  # the AdamW tensors in a group of their own, at adamw_lr
            by_algorithm: dict[str, list] = {"dion3": [], "adamw": []}
            for p in params:  # a tensor, or (name, tensor) from named_parameters()
                by_algorithm[self.algorithm_of({"algorithm": None}, p[1] if isinstance(p, tuple) else p)].append(p)
            params = [{"params": ps, "algorithm": None if name == "dion3" else name}
                      for name, ps in by_algorithm.items() if ps]
        super().__init__(params, {**{k: settings[k] for k in groups}, "algorithm": None})
        if not any(self.algorithm_of(g, p) == "dion3" for g in self.param_groups for p in g["params"]):
            count = sum(len(g["params"]) for g in self.param_groups)
            warnings.warn(f"{type(self).__name__}: none of the {count} parameters is a matrix for Dion3 (a tensor of "
                          ">= 2 dims outside algorithm='adamw' groups): every parameter will take AdamW", stacklevel=2)

    # ----------------------------------------------------------------------------------------
    # Groups and validation.

    def add_param_group(self, param_group: dict) -> None:
        index = len(self.param_groups)
        if param_group.get("algorithm") == "adamw" and "lr" not in param_group:
            param_group = {**param_group, "lr": self.adamw_lr}
        super().add_param_group(param_group)
        self._check_group(f"param group {index}", self.param_groups[-1])

    def _params_to_check(self, group: dict) -> list[torch.Tensor]:
        """The tensors a checkpoint's group settings are checked against: the group's parameters
        (DeepSpeedDion3 gives the originals of a group that ZeRO flattened into one slice)."""
        return group["params"]

    @classmethod
    def _check_group(cls, where: str, group: dict) -> None:
        """Raise ValueError naming the setting and its value when a group's settings are invalid
        for its parameters (at construction, and on a checkpoint's groups before loading them)."""
        if group["algorithm"] not in (None, *ALGORITHMS):
            raise ValueError(f"{where}: algorithm must be one of {ALGORITHMS} or absent, got {group['algorithm']!r}")
        options.check(where, **{k: group[k] for k in options.group_keys(options.TORCH)})
        if group["algorithm"] != "dion3" and group["num_heads"] is None:
            return  # nothing per parameter to check (this runs at every step)
        for i, p in enumerate(group["params"]):
            if group["algorithm"] == "dion3" and p.dim() < 2:
                raise ValueError(f"{where}: algorithm 'dion3' needs tensors with >= 2 dims, got shape {tuple(p.shape)}")
            if cls.algorithm_of(group, p) == "dion3":
                options.check_num_heads(where, group["num_heads"], matrix_shape(p)[0], f"param {i} (shape {tuple(p.shape)})")

    @staticmethod
    def algorithm_of(group: dict, p: torch.Tensor) -> str:
        return group["algorithm"] or ("dion3" if p.dim() >= 2 else "adamw")

    @staticmethod
    def hyperparameters(group: dict) -> Dion3Hyperparameters:
        return options.hyperparameters(**{k: group[k] for k in Dion3Hyperparameters.__dataclass_fields__})

    def _param_names(self) -> dict[torch.Tensor, str]:
        """Each parameter's name: given by ``named_parameters()``, else ``"group i / param j"``."""
        names = {}
        for gi, group in enumerate(self.param_groups):
            given = group.get("param_names")
            for j, p in enumerate(group["params"]):
                names[p] = given[j] if given else f"group {gi} / param {j}"
        return names

    @staticmethod
    def _matrix_names(name: str, p: torch.Tensor) -> list[str]:
        """The names of a parameter's matrices in the engine and the fraction record."""
        return [f"{name}.matrix{e}" for e in range(p.shape[0])] if p.dim() == 3 else [name]

    @property
    def fractions(self) -> Fractions:
        """The f each matrix of a group with the automatic fraction uses (filled at its first step), by
        parameter name (given as ``named_parameters()``), else ``"group i / param j"``; a
        parameter tensor works as a key too."""
        names = self._param_names()
        chosen = {p: self._chosen[first] for p, name in names.items()
                  if (first := self._matrix_names(name, p)[0]) in self._chosen}
        return Fractions(chosen, names)

    def _agree_speeds(self) -> None:
        """At the first step, the speeds the automatic f is chosen by (:class:`.engine.fractions.AgreedSpeeds`).

        Under torch.distributed the ranks agree on the device speed of each Newton-Schulz dtype in
        one collective over the world, at this optimizer's first step, whatever a rank holds (a
        pipeline stage may hold only AdamW tensors, or groups of other dtypes than its peers') and
        whether or not its step is then skipped; later choices (a param group added, a matrix's
        first gradient, a checkpoint without them) use what was agreed: no rank ever waits in a
        collective its peers do not make.
        """
        chosen_by_plan = [(p.device, group["ns_dtype"] or default_ns_dtype(p.device))
                          for group in self.param_groups if plan.chooses_fraction(self.hyperparameters(group))
                          for p in group["params"][:1]]
        if self._speeds is None:
            distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            agreed = fractions.agree_per_dtype(list(set(chosen_by_plan)), dist.group.WORLD if distributed else None)
            self._speeds = fractions.AgreedSpeeds(agreed, distributed)
        for device, dtype in chosen_by_plan:  # a group added since: refused now if its dtype was not agreed
            self._speeds.of(device, dtype)

    # ----------------------------------------------------------------------------------------
    # State.

    def _expected_state_shapes(self, group: dict, p: torch.Tensor) -> list[dict[str, tuple]]:
        """The state shapes a checkpoint may hold for ``p`` (a Dion3 matrix stepped with staleness
        also keeps each row's age)."""
        if self.algorithm_of(group, p) == "dion3":
            rows = (matrix_count(p), matrix_shape(p)[0])
            plain = {"momentum": tuple(p.shape), "variance": rows}
            return [plain, {**plain, "row_age": rows}]
        return [{"step": (), "exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}]

    def _param_indices(self) -> dict[torch.Tensor, int]:
        """Each parameter's index in a state dict (the base class packs them in group order)."""
        return {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["skipped_steps"] = self.skipped_steps
        # The automatic f chosen: a resume keeps it, whatever the device measures then.
        sd["fractions"] = dict(self._chosen)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load everything or nothing: shapes are checked for every parameter before any is set.

        Unlike the base class this keeps state in fp32 whatever the parameters' dtype.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            hint = ""
            if len(groups) == 1 and self._split_from_plain_list:
                hint = (" (a plain parameter list makes two groups, matrices and the AdamW tensors, since "
                        "adamw_lr; a checkpoint from before holds one: build the optimizer from "
                        "[{'params': params}] to load it)")
            raise ValueError(f"checkpoint has {len(groups)} param groups, the optimizer has {len(self.param_groups)}{hint}")
        for gi, (mine, saved) in enumerate(zip(self.param_groups, groups)):
            settings = {k: v for k, v in saved.items() if k != "params"}
            options.check_retired(f"param group {gi}", settings)
            self._check_group(f"param group {gi}", {**mine, **settings, "params": self._params_to_check(mine)})
        names = self._param_names()
        param_matrices = [self._matrix_names(names[p], p) for p in self._param_indices()]
        chosen = plan.fraction_record(state_dict.get("fractions", state_dict.get("auto_fractions", {})),
                                      "checkpoint fractions", param_matrices)
        new_state: dict[torch.Tensor, dict] = {}
        for gi, (mine, saved) in enumerate(zip(self.param_groups, groups)):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(
                    f"param group {gi}: checkpoint has {len(saved['params'])} params, the optimizer has {len(mine['params'])}"
                )
            for p, pid in zip(mine["params"], saved["params"]):
                saved_state = state_dict["state"].get(pid)
                if saved_state is None:
                    continue
                expected = self._expected_state_shapes(mine, p)
                got = {k: tuple(v.shape) for k, v in saved_state.items() if torch.is_tensor(v)}
                if got not in expected:
                    raise ValueError(
                        f"param group {gi}, param {pid} (shape {tuple(p.shape)}): checkpoint state {got} "
                        f"does not match the expected {' or '.join(map(str, expected))}"
                    )
                new_state[p] = {
                    k: v.detach().to(device=p.device if k != "step" else v.device, dtype=torch.float32)
                    .clone(memory_format=torch.contiguous_format)
                    for k, v in saved_state.items()
                }
        self.state = defaultdict(dict, new_state)
        self._engine = None  # its buffers held the old state; the next step builds one on the loaded state
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._chosen = chosen

    # ----------------------------------------------------------------------------------------
    # The step.

    def _check_gradients(self) -> bool:
        """Validate gradients; True when all are usable (:func:`gradients_usable`; one host sync per device)."""
        grads = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"param group {gi}: Dion3 does not support sparse gradients")
                grads.append(p.grad)
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_device[g.device].append(g)
        return all(bool(gradients_usable(same)) for same in by_device.values())

    def skip_step(self) -> None:
        """Count and announce a step skipped for a non-finite gradient (nothing else changes)."""
        self.skipped_steps += 1
        announce_skipped_step(self.skipped_steps)

    @torch.no_grad()
    @kernel_config.scoped_step
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One step of every parameter with a gradient. Everything that can be refused (sparse
        gradients, settings changed since construction) is checked before anything changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._check_group(f"param group {gi}", group)
        self._agree_speeds()  # before a skip: the ranks' first steps agree on the speed together
        if not self._check_gradients():
            self.skip_step()
            return loss
        matrices: list[tuple[int, torch.Tensor]] = []
        adamw: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # (group, step count, device) -> params
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.algorithm_of(group, p) == "adamw":
                    state = self.state.get(p)
                    adamw[gi, int(state["step"].item()) + 1 if state else 1, p.device].append(p)
                else:
                    matrices.append((gi, p))
        settings = [self.hyperparameters(group) for group in self.param_groups]
        engine = self._engine_for(matrices, settings)  # may refuse (a dtype the ranks agreed no speed for)
        # From here on the step changes state; nothing below refuses anything.
        for (gi, count, _), params in adamw.items():
            group = self.param_groups[gi]
            for p in params:
                self._init_adamw_state(p)["step"] += 1
            rule.adamw_step(params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                            [self.state[p]["exp_avg_sq"] for p in params], count,
                            group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for gi, p in matrices:  # this step's gradients and schedule (lr, weight decay)
            shards = self._shards[p]
            grads = [p.grad] if p.dim() == 2 else matrix_values(p.grad).unbind(0)
            for shard, grad in zip(shards, grads):
                shard.grad, shard.hp = grad, settings[gi]
        copied = [p for _, p in matrices if not p.is_contiguous()]
        engine.step(prologue=(lambda: [self._copies[p].copy_(p) for p in copied]) if copied else None,
                    epilogue=(lambda: [p.copy_(self._copies[p]) for p in copied]) if copied else None,
                    around_key=tuple(p.data_ptr() for p in copied))
        return loss

    def _engine_for(self, matrices: list[tuple[int, torch.Tensor]], settings: list[Dion3Hyperparameters]) -> Dion3Engine:
        """The engine of these matrices (``settings``: each group's): built anew when the set of
        matrices with a gradient, their storage or their groups' batch settings changed, or a
        checkpoint replaced their state. Each parameter's state is then a view of the engine's
        buffers (one per shape group)."""
        key = (tuple((gi, id(p), p.data_ptr()) for gi, p in matrices),
               tuple(cuda_graph_module.baked_settings(hp) for hp in settings))
        if self._engine is not None and key == self._engine_key:
            return self._engine
        names = self._param_names()
        shards: dict[torch.Tensor, list[MatrixShard]] = {}
        for gi, p in matrices:
            hp = settings[gi]
            state = self.state[p]
            carried: list[dict] = [{} for _ in range(matrix_count(p))]
            if "momentum" in state:  # stepped before (or loaded): the engine copies it in
                rows = [part for part in ("variance", "row_age") if part in state]
                carried = [{"momentum": m, **{part: state[part][e] for part in rows}}
                           for e, m in enumerate(matrix_view(state["momentum"]))]
            weight = matrix_view(self._contiguous_weight(p))
            grad = matrix_values(p.grad)
            shards[p] = [MatrixShard(name, weight[e], grad[e], matrix_shape(p), Sharding.full(), None, hp, carried[e])
                         for e, name in enumerate(self._matrix_names(names[p], p))]
        engine = Dion3Engine([s for own in shards.values() for s in own], cuda_graph=self.cuda_graph,
                             local=True, fresh_grads=True, speeds=self._speeds, chosen=self._chosen)
        self._chosen.update(engine.chosen_fractions())
        for p, own in shards.items():
            state = self.state[p]
            for part in own[0].state:
                state[part] = stacked_view([s.state[part] for s in own])
            state["momentum"] = state["momentum"].view(p.shape)
        self._engine, self._engine_key, self._shards = engine, key, shards
        return engine

    def _init_adamw_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return state

    def _contiguous_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The weight itself, or for a non-contiguous one (a channels_last conv weight, a transposed
        view) a contiguous buffer that the step fills from it and writes back; the buffer is kept,
        so a CUDA graph of the step finds it at the same address."""
        if p.is_contiguous():
            return p
        if p not in self._copies:
            self._copies[p] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        return self._copies[p]
