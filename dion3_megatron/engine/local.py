"""The step of matrices one process holds whole: scored, selected, orthogonalized and updated on
the device, with no exchange (:func:`step_whole_matrices`), and the exchange of an engine's groups
held whole (:class:`WholeExchange`), which steps through it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..core import rule
from ..core.rounding import Rounding
from ..core.rule import Dion3Hyperparameters
from . import cuda_graph as cuda_graph_module
from .exchange import BlockExchange, Traffic, folded_decay_of, group_hp, sub_batch_mu, update_factors_of
from .plan import ShapeGroup


# --------------------------------------------------------------------------------------------
# The whole-matrix step: matrices one process holds whole (the engine's one-rank groups: the
# single-process optimizer's, a ZeRO rank's, a data-parallel owner's) need no exchange.


@dataclass
class WholeMatrices:
    """A batch of B same-shape whole matrices one process steps by itself (any views; the state
    is written in place)."""

    weight: torch.Tensor | list[torch.Tensor]  # (B, n, c), or B separate (n, c) tensors
    momentum: torch.Tensor  # (B, n, c) fp32, or bf16 with a rounding
    variance: torch.Tensor  # (B, n) fp32
    hp: Dion3Hyperparameters  # the batch's settings, fraction already a number
    grads: Optional[list[torch.Tensor]] = None  # B (n, c), added to the momentum by the step
    scores: Optional[torch.Tensor] = None  # else the momentum's (B, n) row scores (accumulate_and_score) or None
    hps: Optional[list[Dion3Hyperparameters]] = None  # each matrix's own lr, weight decay, mu (default: hp)
    mu: Optional[float | torch.Tensor] = None  # the applied rows' decay, or (B,) on the device; default: hp's
    factors: Optional[rule.UpdateFactors] = None  # default: from hps
    age: Optional[torch.Tensor] = None  # (B, n) steps since each row was applied: needed when hp.staleness
    # the caller's accumulation left the momentum decayed (rule.folded_decay): the step, which
    # selects every row, orthogonalizes it as it is and does not decay it again
    momentum_decayed: bool = False
    rounding: Optional[Rounding] = None  # a bf16 momentum's: its rounded writes hash their noise from it

    def __post_init__(self) -> None:
        if self.hps is not None and self.mu is None:  # their mus may differ: the caller keeps the device copy
            raise ValueError("WholeMatrices with per-matrix settings (hps) needs their mu")

    @property
    def count(self) -> int:
        return len(self.weight) if isinstance(self.weight, (list, tuple)) else self.weight.shape[0]

    def settings(self) -> list[Dion3Hyperparameters]:
        return self.hps if self.hps is not None else [self.hp] * self.count

    def graph_key(self) -> tuple:
        """What a captured step of this batch bakes in: buffers, weights, gradients, settings."""
        weights = tuple(w.data_ptr() for w in self.weight) if isinstance(self.weight, (list, tuple)) else self.weight.data_ptr()
        return (
            self.momentum.data_ptr(),
            tuple(self.momentum.shape),
            self.variance.data_ptr(),
            tuple(self.variance.stride()),
            weights,
            tuple(g.data_ptr() for g in self.grads) if self.grads is not None else None,
            self.scores.data_ptr() if self.scores is not None else None,
            self.age.data_ptr() if self.age is not None else None,
            self.rounding.steps.data_ptr() if self.rounding is not None else None,
            self.momentum_decayed,
            cuda_graph_module.baked_settings(self.hp),
            tuple(cuda_graph_module.baked_settings(hp) for hp in self.hps) if self.hps is not None else None,
        )


def step_whole_matrices(entries: list[WholeMatrices], graph: Optional[cuda_graph_module.StepGraph] = None) -> None:
    """The Dion3 step of whole matrices on one process. Selected blocks of one shape are
    orthogonalized as one batch.

    With ``graph``, and every entry on one CUDA device, the step replays from it (captured at its
    third call with these tensors and settings; lr and weight decay reach it as factors). Gradients
    given as ``grads`` are added inside the graph: a caller whose gradients are new tensors every
    step adds them first (:func:`rule.accumulate_and_score`) and passes the ``scores``.
    """
    device = entries[0].momentum.device if entries else None
    if graph is None or device is None or any(e.momentum.device != device for e in entries) or not cuda_graph_module.usable(device):
        _step_whole_eager(entries)
        return
    factors = [e.factors if e.factors is not None else _whole_factors(e) for e in entries]

    def step(graph_factors: list[rule.UpdateFactors]) -> None:
        _step_whole_eager([dataclasses.replace(e, factors=f) for e, f in zip(entries, graph_factors)])

    graph.run_with_factors(tuple(e.graph_key() for e in entries), step, factors, device)


def _whole_factors(e: WholeMatrices) -> rule.UpdateFactors:
    return rule.update_factors(e.settings(), rule.resolved(e.hp.fraction), *e.momentum.shape[1:])


def _step_whole_eager(entries: list[WholeMatrices]) -> None:
    batches: dict[tuple, list] = {}
    for e in entries:
        hp = e.hp
        fraction = rule.resolved(hp.fraction)
        decayed = e.momentum_decayed
        if e.grads is not None:
            decay = rule.folded_decay(hp, e.momentum.shape[1], e.mu)
            if e.rounding is not None:
                e.rounding.advance()
            scores = rule.accumulate_and_score(e.momentum, e.grads, out=e.scores, decay=decay, rounding=e.rounding)
            decayed = decay is not None
        else:
            scores = e.scores if e.scores is not None else rule.row_scores(e.momentum)
        age = e.age
        if hp.staleness:
            assert age is not None, "staleness needs the rows' ages"
            scores = rule.staleness_boost(scores, age, hp.staleness, fraction)
        idx = rule.select_rows(scores, fraction, hp.num_heads)
        if hp.staleness:
            assert age is not None
            rule.age_rows(age, idx)
        mu = e.mu if e.mu is not None else rule.momentum_decay(hp, fraction)
        # every row selected (f = 1): the momentum itself is orthogonalized, its rows not copied out
        # first; it decays after, unless its accumulation already did (rule.folded_decay)
        every_row = idx.shape[1] == e.momentum.shape[1]
        if decayed and not every_row:
            raise RuntimeError("the momentum came decayed for a step that does not select every row")
        selected = e.momentum if every_row else rule.take_selected(e.momentum, idx, mu, e.rounding)
        key = (tuple(selected.shape[1:]), selected.device, selected.dtype, hp.ns_method, hp.ns_dtype)
        batches.setdefault(key, []).append((e, idx, selected, mu if every_row and not decayed else None))
    for batch in batches.values():
        stacked = torch.cat([b[2] for b in batch]) if len(batch) > 1 else batch[0][2]
        ortho = rule.orthogonalize_rows(stacked, batch[0][0].hp).split([b[2].shape[0] for b in batch])
        for (e, idx, _, later_mu), block in zip(batch, ortho):
            if later_mu is not None:  # the orthogonalization has read it
                if e.rounding is None:
                    rule.decay_momentum(e.momentum, later_mu)
                else:
                    rule.decay_momentum(e.momentum, later_mu, e.rounding)
            weights = list(e.weight.unbind(0)) if torch.is_tensor(e.weight) else list(e.weight)
            factors = e.factors if e.factors is not None else _whole_factors(e)
            rule.normalize_and_apply(weights, e.variance, idx, block, e.hp.beta2, e.hp.eps, factors)


class WholeExchange(BlockExchange):
    """Matrices this rank holds whole: no exchange, no host round trip. All such groups of an
    engine step together (:meth:`step_all`), so same-shape blocks share one orthogonalization and
    one CUDA graph replays them. Gradients that are new tensors every step are added to the
    momentum first, outside the graph (:meth:`accumulate`)."""

    host_rows = False
    static = True

    def __init__(self, sg: ShapeGroup, traffic: Traffic, momentum_in_place: bool = False) -> None:
        super().__init__(sg, traffic, momentum_in_place)
        self._accumulated: Optional[list[tuple[torch.Tensor, bool]]] = None  # per sub-batch: (scores, decayed)

    def factors(self) -> list[rule.UpdateFactors]:
        return [update_factors_of(self.sg, sub.index) for sub in self.subs]

    def accumulate(self) -> None:
        """Add this step's gradients to the momentum and score the rows now, into buffers the
        step (graphed or not) then reads."""
        sg = self.sg
        n, m = sg.key.shape
        if self._accumulated is None:
            self._accumulated = [
                (torch.empty(sub.momentum.shape[:2], dtype=torch.float32, device=sub.momentum.device), False) for sub in self.subs
            ]
        for p, sub in enumerate(self.subs):
            decay = folded_decay_of(sg, sub_batch_mu(sg, sub, sub.momentum.device))
            scores = self._accumulated[p][0]
            grads = [sg.shards[j].stepped_grad() for j in sub.index]  # (a transposed weight's gradient has no (n, m) view)
            if sub.rounding is not None:
                sub.rounding.advance()
            grads = [g if g.shape == (n, m) else g.view(n, m) for g in grads]
            rule.accumulate_and_score(sub.momentum, grads, out=scores, decay=decay, rounding=sub.rounding)
            self._accumulated[p] = (scores, decay is not None)

    def graph_key(self) -> tuple:
        """What a captured step of the group bakes in (its batches' keys): once :meth:`accumulate`
        has run, the score buffers instead of the gradients' addresses."""
        return tuple(e.graph_key() for e in self.entries())

    def entries(self, factors: Optional[list[rule.UpdateFactors]] = None) -> list[WholeMatrices]:
        """The group's sub-batches as :class:`WholeMatrices`, each matrix with its own settings
        (``factors`` as device tensors inside a graph of the engine's whole step)."""
        sg = self.sg
        n, m = sg.key.shape
        hp = group_hp(sg)
        entries = []
        for p, sub in enumerate(self.subs):
            accumulated = self._accumulated[p] if self._accumulated is not None else None
            entries.append(
                WholeMatrices(
                    [w if (w := sg.shards[j].weight).shape == (n, m) else w.view(n, m) for j in sub.index],
                    sub.momentum,
                    sub.variance,
                    hp,
                    grads=None if accumulated else [sg.shards[j].stepped_grad().view(n, m) for j in sub.index],
                    scores=accumulated[0] if accumulated else None,
                    momentum_decayed=accumulated[1] if accumulated else False,
                    hps=[sg.shards[j].hp for j in sub.index],
                    mu=sub_batch_mu(sg, sub, sub.momentum.device),
                    factors=factors[p] if factors is not None else None,
                    age=sub.age,
                    rounding=sub.rounding,
                )
            )
        return entries

    @staticmethod
    def step_all(
        exchanges: list["WholeExchange"], graph: Optional[cuda_graph_module.StepGraph], factors: Optional[list[rule.UpdateFactors]] = None
    ) -> None:
        """Accumulate, score, select, orthogonalize and update every group of ``exchanges``."""
        entries, start = [], 0
        for ex in exchanges:
            count = len(ex.subs)
            entries += ex.entries(factors[start : start + count] if factors is not None else None)
            start += count
        step_whole_matrices(entries, graph)
