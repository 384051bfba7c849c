"""One optimizer's engine across its steps: the session every front end steps through.

A front end hands the session its matrices as :class:`~.sharding.MatrixShard` s and a key that
says what they were built from (which parameters, their storage, the settings that shape the
plan); the session owns the rest:

* the device speeds the automatic f is chosen by, agreed once by the ranks (:meth:`agree_speeds`);
* the engine, built when the key changes and reused while it does not (:meth:`engine_for`);
* the state a rebuilt engine carries over from the one it replaces (by matrix name);
* the record of the automatic f (:attr:`record`): every matrix the ranks of :attr:`group` chose for,
  gathered in one collective at each build, so the rank that writes a checkpoint names them all, and
  a resume (:meth:`restore`) steps each matrix at the f it first chose.
"""

from __future__ import annotations

import logging
from typing import Callable, Hashable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from . import offload as offloading
from .engine import Dion3Engine
from .fractions import AgreedSpeeds, agreed_speeds
from .sharding import MatrixShard

logger = logging.getLogger(__name__)

Record = dict[str, tuple[int, float]]  # matrix name -> (its param group's index, the automatic f)


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class EngineSession:
    """The engine of one optimizer (:class:`~.engine.Dion3Engine`), built and rebuilt by key.

    group: the ranks that build their engines together (the engine's plan is checked over them),
    agree on the device speeds and share the record (None: the world). The front ends: the torch
    ``Dion3`` (whole parameters, DTensor pieces), DeepSpeed's classes (whole parameters, ZeRO
    partitions over the tensor x data-parallel group) and ``MegatronDion3``. offload: the engines
    keep their state in host memory and stream it to the GPU for each step (:mod:`.offload`;
    nothing changes where there is no GPU).
    """

    def __init__(self, cuda_graph: bool, group: Optional[dist.ProcessGroup] = None, offload: bool = False) -> None:
        self.cuda_graph = cuda_graph
        self.group = group
        self.offload = offload
        self.engine: Optional[Dion3Engine] = None
        self.speeds: Optional[AgreedSpeeds] = None
        self.record: Record = {}
        self._key: Optional[Hashable] = None

    def offload_device(self, device: torch.device) -> Optional[torch.device]:
        """The device an offloaded step of tensors held on ``device`` runs on; None where the step
        is not offloaded (:func:`~.offload.step_device`)."""
        return offloading.step_device(self.offload, device)

    def compute_device(self, device: torch.device) -> torch.device:
        """Where the step of tensors held on ``device`` computes (offloaded: on the GPU)."""
        return self.offload_device(device) or device

    # ----------------------------------------------------------------------------------------
    # Speeds.

    def agree_speeds(self, wanted: Iterable[tuple[torch.device, torch.dtype]]) -> AgreedSpeeds:
        """The speeds of the Newton-Schulz dtypes the automatic f is chosen by (``wanted``: this
        rank's (device, dtype) pairs). The first call is collective over :attr:`group` (every rank
        calls it at the same point, whatever it holds); later calls make none, and refuse a dtype
        no rank agreed on (ValueError, on every rank that asks for it).
        """
        wanted = sorted(set(wanted), key=str)
        if self.speeds is None:
            self.speeds = agreed_speeds(wanted, self.group)
        for device, dtype in wanted:
            self.speeds.of(device, dtype)
        return self.speeds

    # ----------------------------------------------------------------------------------------
    # The engine.

    def current(self, key: Hashable) -> Optional[Dion3Engine]:
        """The engine built for ``key``, or None where there is none (or another key's)."""
        return self.engine if self.engine is not None and key == self._key else None

    def engine_for(
        self,
        key: Hashable,
        shards: Callable[[], list[MatrixShard]],
        *,
        groups_of: Mapping[str, int],
        local: bool = False,
        fresh_grads: bool = False,
        momentum_in_place: bool = False,
        step_share: float = 1.0,
        gather: bool = False,
    ) -> Dion3Engine:
        """The engine for ``key``: the current one, or one built on ``shards()`` (collective over
        :attr:`group` unless ``local``: every rank builds at the same step).

        A shard that comes without state takes that of the matrix of the same name in the engine
        it replaces, where its piece has the same shape (a front end hands state of its own only
        where it loaded a checkpoint or keeps the state itself). ``groups_of``: each matrix's param
        group, for the record. ``gather``: the ranks of :attr:`group` hold different matrices (ZeRO
        partitions, FSDP2 experts, Megatron's layer-wise shards), so the record of each build is
        gathered in one collective, every rank alike. The other arguments are the engine's.
        """
        current = self.current(key)
        if current is not None:
            return current
        built = shards()
        self._carry(built)
        if self.speeds is None:
            self.speeds = AgreedSpeeds({}, _distributed(self.group))
        engine = Dion3Engine(
            built,
            cuda_graph=self.cuda_graph,
            check_group=self.group,
            step_share=step_share,
            local=local,
            fresh_grads=fresh_grads,
            speeds=self.speeds,
            chosen={name: f for name, (_, f) in self.record.items()},
            momentum_in_place=momentum_in_place,
            offload=self.offload_device(built[0].weight.device) if built else None,
        )
        chosen: Record = {name: (groups_of[name], f) for name, f in engine.chosen_fractions().items()}
        if gather and _distributed(self.group):
            everyone: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, chosen, group=self.group)
            chosen = {name: entry for theirs in everyone for name, entry in theirs.items()}
        self.record.update(chosen)
        self._announce(engine, step_share)
        self.engine, self._key = engine, key
        return engine

    def _carry(self, shards: list[MatrixShard]) -> None:
        """Give the shards without state the state of the same matrices in the engine being
        replaced (row ages only where the new settings keep them)."""
        if self.engine is None:
            return
        before = {s.name: s for sg in self.engine.plan for s in sg.shards}
        for shard in shards:
            old = before.get(shard.name)
            if shard.state or old is None or old.weight.shape != shard.weight.shape or old.sharding != shard.sharding:
                continue
            shard.state.update({k: v for k, v in old.state.items() if k != "row_age" or shard.hp.staleness})

    def _announce(self, engine: Dion3Engine, step_share: float) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        auto = engine.auto_fractions()
        if auto:
            logger.info(
                "Dion3 fraction=auto chose (rows x cols: f) %s; this rank steps %.2f of the model's matrices",
                ", ".join(f"{n}x{m}: {f:g}" for (n, m), f in sorted(auto.items())),
                step_share,
            )
        if self.offload and engine.plan:
            if engine.offload is not None:
                logger.info("Dion3 offload: the state lives in host memory and streams to %s for each step", engine.offload)
            else:
                logger.info("Dion3 offload: no GPU to stream the state to; it lives in host memory already")
        elif engine.plan and torch.cuda.is_available() and all(s.weight.device.type == "cpu" for sg in engine.plan for s in sg.shards):
            # (FSDP2's CPUOffloadPolicy puts the pieces there: orthogonalizing on the host is slow)
            logger.warning(
                "Dion3: the matrices are in host memory (FSDP2's CPUOffloadPolicy, say) and their step runs on the host's cores; "
                "Dion3(..., offload=True) streams it through the GPU, one shape group at a time"
            )

    # ----------------------------------------------------------------------------------------
    # The record.

    def records(self, count: int) -> list[dict[str, float]]:
        """The record as one ``{matrix name: f}`` per param group (``count`` groups)."""
        out: list[dict[str, float]] = [{} for _ in range(count)]
        for name, (group, f) in sorted(self.record.items()):
            if group < count:
                out[group][name] = f
        return out

    def restore(self, records: list[dict[str, float]]) -> None:
        """A checkpoint's record (one per param group, checked); the next step builds a new engine,
        on the state the front end loaded."""
        self.record = {name: (gi, f) for gi, record in enumerate(records) for name, f in record.items()}
        self.engine, self._key = None, None

    def chosen(self, name: str) -> Optional[float]:
        """The automatic f of a matrix (None: none chosen for it)."""
        entry = self.record.get(name)
        return entry[1] if entry is not None else None
