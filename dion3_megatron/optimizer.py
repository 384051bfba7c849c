"""Dion3 as a ``torch.optim.Optimizer`` for one process (or DDP, where every rank steps alike).

Matrices (>= 2-D) take the Dion3 rule, everything else AdamW, unless a param group says
``algorithm="dion3"`` or ``algorithm="adamw"``. A 3-D tensor is a batch of matrices (MoE experts);
4-D and larger (conv weights) flatten to (out, rest). The selected rows of every matrix whose
selected block has the same shape are orthogonalized as one batch: the single-process form of
megabatching. The math itself lives in :mod:`dion3_megatron.core.rule`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from . import options
from .core import cost_model, rule
from .engine import cuda_graph as cuda_graph_module, fractions
from .engine.local import WholeMatrices, step_whole_matrices
from .frontend import announce_skipped_step, gradients_usable, matrix_count, matrix_shape, matrix_values, matrix_view
from .kernels import config as kernel_config
from .core.ortho import default_ns_dtype
from .core.rule import Dion3Hyperparameters

ALGORITHMS = ("dion3", "adamw")


class Fractions(dict):
    """What ``fraction="auto"`` chose, ``{parameter name: f}``: the names of named parameters, else
    ``"group i / param j"``. A parameter tensor works as a key too (``fractions[p]``, ``p in
    fractions``, ``fractions.get(p)``)."""

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


@dataclass
class _Bucket:
    """Same-shape matrices of one param group whose Dion3 state lives in two buffers, so that
    their step runs as batched ops (the single-process form of megabatching)."""

    param_ids: list[int]
    momentum: torch.Tensor  # (matrices, rows, cols) fp32
    variance: torch.Tensor  # (matrices, rows) fp32
    scores: torch.Tensor  # (matrices, rows) fp32: this step's row scores (a fixed buffer for the graph)
    age: Optional[torch.Tensor]  # (matrices, rows) fp32 steps since each row was applied (with staleness)

    def holds(self, params: list[torch.Tensor], state: dict) -> bool:
        if [id(p) for p in params] != self.param_ids:
            return False
        start = 0
        for p in params:
            if state[p]["momentum"].data_ptr() != self.momentum[start].data_ptr():
                return False
            start += matrix_count(p)
        return True


@options.documented(options.TORCH)
class Dion3(torch.optim.Optimizer):
    """Dion3: top-fraction row selection, Gram Newton-Schulz, NorMuon normalization, error feedback.

    Args:
        params: parameters (or ``named_parameters()``) or param groups. A group may set
            ``algorithm`` ("dion3" | "adamw") and any option below but ``kernels`` and
            ``cuda_graph``; ``fraction`` and ``num_heads`` may differ per group.
        **settings: the options below (keyword only; declared in :mod:`dion3_megatron.options`).

    ``fraction="auto"`` is chosen per matrix at the first step by :mod:`dion3_megatron.engine.fractions` from its
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
        self._auto_fractions: dict[torch.Tensor, float] = {}
        self._agreed_speeds: Optional[dict] = None  # what the ranks agreed for "auto" (None: not yet)
        self._buckets: dict[tuple, _Bucket] = {}
        self._copies: dict[torch.Tensor, torch.Tensor] = {}  # non-contiguous Dion3 weight -> its working copy
        self._graph = cuda_graph_module.StepGraph()
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
        return Dion3Hyperparameters(**{k: group[k] for k in Dion3Hyperparameters.__dataclass_fields__})

    @property
    def fractions(self) -> Fractions:
        """The f each matrix of a ``fraction="auto"`` group uses (filled at the first step), by
        parameter name (given as ``named_parameters()``), else ``"group i / param j"``; a
        parameter tensor works as a key too."""
        names = {}
        for gi, group in enumerate(self.param_groups):
            given = group.get("param_names")
            for j, p in enumerate(group["params"]):
                names[p] = given[j] if given else f"group {gi} / param {j}"
        return Fractions(self._auto_fractions, names)

    def _resolve_auto_fractions(self) -> None:
        """Choose f for every not yet resolved matrix of the "auto" groups (:mod:`.engine.fractions`, :mod:`.core.cost_model`).

        Same-shape matrices are orthogonalized as one batch here, which the cost model counts.
        Under torch.distributed the ranks agree on the device speed of each Newton-Schulz dtype in
        one collective over the world, at this optimizer's first step, whatever a rank holds (a
        pipeline stage may hold only AdamW tensors, or groups of other dtypes than its peers') and
        whether or not its step is then skipped; later choices (a param group added, a checkpoint
        without them) use what was agreed: no rank ever waits in a collective its peers do not make.
        """
        auto_groups = [group for group in self.param_groups if group["fraction"] == options.AUTO]
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self._agreed_speeds is None:
            local = {(p.device, group["ns_dtype"] or default_ns_dtype(p.device))
                     for group in auto_groups for p in group["params"][:1]}
            self._agreed_speeds = fractions.agree_per_dtype(list(local), dist.group.WORLD if distributed else None)
        todo = [(group, p) for group in auto_groups
                for p in group["params"] if self.algorithm_of(group, p) == "dion3" and p not in self._auto_fractions]
        shapes = Counter(matrix_shape(p) for _, p in todo for _ in range(matrix_count(p)))
        for group, p in todo:
            hp = self.hyperparameters(group)
            dtype = hp.ns_dtype or default_ns_dtype(p.device)
            if dtype not in self._agreed_speeds:
                if distributed:
                    raise ValueError(f"fraction='auto' with ns_dtype={dtype}: no rank stepped a group of that dtype at "
                                     "the first step, when the ranks agreed on the device's speed; give such groups "
                                     "from the start, or set their fraction")
                self._agreed_speeds[dtype] = fractions.measure(p.device, dtype)
            self._auto_fractions[p] = cost_model.choose_fraction(
                *matrix_shape(p), self._agreed_speeds[dtype], 1, shapes[matrix_shape(p)], hp.ns_method, hp.num_heads)

    # ----------------------------------------------------------------------------------------
    # State.

    def _init_state(self, group: dict, p: torch.Tensor) -> dict:
        state = self.state[p]
        if state:
            return state
        if self.algorithm_of(group, p) == "dion3":
            state["momentum"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["variance"] = torch.zeros(matrix_count(p), matrix_shape(p)[0], dtype=torch.float32, device=p.device)
        else:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return state

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
        # What fraction="auto" chose: a resume keeps it, whatever the device measures then.
        index = self._param_indices()
        sd["auto_fractions"] = {index[p]: f for p, f in self._auto_fractions.items()}
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
        params = list(self._param_indices())
        auto_fractions = {}
        for pid, f in state_dict.get("auto_fractions", {}).items():
            if not (isinstance(pid, int) and 0 <= pid < len(params) and f in cost_model.CANDIDATE_FRACTIONS):
                raise ValueError(f"checkpoint auto_fractions: param {pid!r} with fraction {f!r} is not a parameter "
                                 f"index below {len(params)} with one of {cost_model.CANDIDATE_FRACTIONS}")
            auto_fractions[params[pid]] = f
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
        self._buckets.clear()  # their buffers held the old state; the next step rebuilds them
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._auto_fractions = auto_fractions

    def _bucket(self, key: tuple, params: list[torch.Tensor], with_age: bool) -> "_Bucket":
        """The state buffers of these same-shape matrices (one group), (re)built when the members
        changed or a checkpoint load replaced their state; each param's state is a view of them.
        ``with_age``: the rows' ages too (for staleness; zero where a matrix has none yet)."""
        bucket = self._buckets.get(key)
        if bucket is not None and bucket.holds(params, self.state) and (bucket.age is not None) == with_age:
            return bucket
        sizes = [matrix_count(p) for p in params]
        first = matrix_view(self.state[params[0]]["momentum"])
        momentum = torch.empty((sum(sizes), *first.shape[1:]), dtype=torch.float32, device=first.device)
        variance = torch.empty(momentum.shape[:-1], dtype=torch.float32, device=first.device)
        age = torch.empty_like(variance) if with_age else None
        start = 0
        for p, size in zip(params, sizes):
            state = self.state[p]
            momentum[start:start + size].copy_(matrix_view(state["momentum"]))
            variance[start:start + size].copy_(state["variance"])
            state["momentum"] = momentum[start:start + size].view(p.shape)
            state["variance"] = variance[start:start + size]
            if age is not None:
                if "row_age" in state:
                    age[start:start + size].copy_(state["row_age"])
                else:
                    age[start:start + size].zero_()
                state["row_age"] = age[start:start + size]
            start += size
        bucket = _Bucket([id(p) for p in params], momentum, variance, torch.empty_like(variance), age)
        self._buckets[key] = bucket
        return bucket

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
        self._resolve_auto_fractions()  # before a skip: the ranks' first steps agree on the speed together
        if not self._check_gradients():
            self.skip_step()
            return loss
        members: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        settings: dict[tuple, Dion3Hyperparameters] = {}
        adamw: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # (group, step count, device) -> params
        for gi, group in enumerate(self.param_groups):
            group_hp = self.hyperparameters(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.algorithm_of(group, p) == "adamw":
                    state = self.state.get(p)
                    adamw[gi, int(state["step"].item()) + 1 if state else 1, p.device].append(p)
                    continue
                fraction = self._auto_fractions[p] if group_hp.fraction == options.AUTO else group_hp.fraction
                key = (gi, matrix_shape(p), p.device, fraction)
                if key not in settings:
                    settings[key] = group_hp if fraction == group_hp.fraction else dataclasses.replace(group_hp, fraction=fraction)
                members[key].append(p)
        # From here on the step changes state; nothing below refuses anything.
        for (gi, count, _), params in adamw.items():
            group = self.param_groups[gi]
            for p in params:
                self._init_state(group, p)["step"] += 1
            rule.adamw_step(params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                            [self.state[p]["exp_avg_sq"] for p in params], count,
                            group["lr"], group["betas"], group["eps"], group["weight_decay"])
        self._buckets = {key: bucket for key, bucket in self._buckets.items() if key in members}
        matrices, copied = [], []
        for key, params in members.items():
            for p in params:
                self._init_state(self.param_groups[key[0]], p)
            bucket = self._bucket(key, params, with_age=settings[key].staleness > 0)
            # outside the graph: gradients are new tensors every step
            decay = rule.folded_decay(settings[key], bucket.momentum.shape[1])
            rule.accumulate_and_score(bucket.momentum, [g for p in params for g in matrix_values(p.grad).unbind(0)],
                                      out=bucket.scores, decay=decay)
            copied += [p for p in params if not p.is_contiguous()]
            weights = [w for p in params for w in matrix_view(self._contiguous_weight(p)).unbind(0)]
            matrices.append(WholeMatrices(weights, bucket.momentum, bucket.variance, settings[key],
                                          scores=bucket.scores, age=bucket.age, momentum_decayed=decay is not None))
        step_whole_matrices(matrices, self._graph if self.cuda_graph else None)
        for p in copied:
            p.copy_(self._copies[p])
        return loss

    def _contiguous_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The weight itself, or for a non-contiguous one (a channels_last conv weight, a transposed
        view) a contiguous copy that the step updates and :meth:`step` writes back; the copy's
        buffer is kept, so a CUDA graph of the step finds it at the same address."""
        if p.is_contiguous():
            return p
        buffer = self._copies.get(p)
        if buffer is None:
            buffer = self._copies[p] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        return buffer.copy_(p)
