"""HIST: hierarchical independent submodel training (seed 002).

W. Fang, D.-J. Han, C. G. Brinton, "Submodel Partitioning in Hierarchical Federated Learning:
Algorithm Design and Convergence Analysis", Algorithm 1, eqs. (2)–(7); digest
``papers/seed_002_hist.md`` §2–3.

Theory of operation
-------------------
Global round ``m`` (``E`` local steps = ``edge_rounds`` x ``H``):

1. cloud: draw masks — for every partitioned hidden layer a random split of its neurons into
   one sorted index set per cell, from stream ``(seed, "hist-partition", rollout, m)`` (its own
   stream: minibatches and quantizers are not shifted by it) — and send cell ``j`` the
   extracted submodel ``p_j ⊙ x`` as a physically smaller network                          (2), (7)
2. edge/devices: exactly Hier-Local-QSGD on the submodel — ``H = local_steps`` SGD steps per
   device, a uniform cell average every ``H`` steps, ``edge_rounds = E/H`` times            (4), (5)
3. cloud: copy each cell's partitioned slices back (a masked sum, not an average) and average
   the shared tensors uniformly over cells                                                  (6)

Strategies (``fedtier.algorithms.strategies``): an edge aggregator works on the cell's submodel
changes like on any model's. The cloud has nothing to vote on — each partitioned slice comes
from one cell only — so its rule must be ``mean`` (other rules are refused); a server optimizer
takes the reassembled model's change as its pseudo-gradient.

Devices and edges never see the index sets; they work in submodel coordinates, so HIST uses
``hier_qsgd``'s device and edge roles (and its quantizers: submodel changes are quantized like
any other); its edge only refuses an edge optimizer. The submodel width of each cell is fixed
across rounds, so its ORT artifacts are built once. See ``fedtier.training.submodels`` for the
choice about shared tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from fedtier.algorithms import aggregate, strategies
from fedtier.algorithms.base import Action, Note, Tensors
from fedtier.algorithms.cloud import Cloud as _Cloud
from fedtier.algorithms.hier_qsgd import Device, HierConfig
from fedtier.algorithms.hier_qsgd import Edge as _Edge
from fedtier.rng import stream
from fedtier.training.layout import ArchSpec
from fedtier.training.submodels import Partition, draw, extract, plan_for, reassemble
from fedtier.wire.messages import CellUpdate

NAME = "hist"

__all__ = ["HistConfig", "Device", "Edge", "Cloud", "NAME"]


@dataclass(frozen=True, slots=True)
class HistConfig(HierConfig):
    """``HierConfig`` read as HIST's schedule: ``local_steps`` = H (steps between edge
    aggregations), ``edge_rounds`` = E/H (edge aggregations per global round)."""

    ALGORITHM: ClassVar[str] = NAME


class Edge(_Edge):
    """``hier_qsgd``'s edge, working on its cell's submodel; it refuses an edge optimizer, whose moments would
    outlive the round's partition."""

    EDGE_OPTIMIZER_REFUSAL = ("hist redraws which neurons a cell trains every round: an edge optimizer's moments "
                              "would mix different neurons")


class Cloud(_Cloud):
    """Partitions the global model every round, sends each cell its submodel, reassembles."""

    def __init__(self, *, arch: ArchSpec, **kwargs: Any) -> None:
        """
        Args:
            arch: the full model's architecture (an MLP); its hidden layers are partitioned.
            **kwargs: as for ``fedtier.algorithms.cloud.Cloud``.
        """
        super().__init__(**kwargs)
        if self.aggregator_spec.rule != "mean":
            raise strategies.StrategyError(f"hist's cloud reassembles disjoint submodels (one cell per slice): there "
                                           f"is nothing for a {self.aggregator_spec.rule!r} rule to vote on; use "
                                           "'mean' at the cloud (any rule at the edge)")
        self.cell_order: Sequence[str] = sorted(self.cells)
        self.plan = plan_for(arch, len(self.cell_order))
        self.partition: Partition | None = None
        self._subs: dict[str, dict[str, Any]] = {}

    def _prepare_round(self) -> list[Action]:
        seed = int(self.config.to_dict().get("seed", 0))
        self.partition = draw(self.plan, len(self.cell_order), stream(seed, "hist-partition", self.rollout, self.round))
        self._subs = {cell: extract(self.partition, j, self.params) for j, cell in enumerate(self.cell_order)}
        return [Note("partition_drawn", {"round": self.round, "seed": seed,
                                         "sizes": {c: list(self.partition.sizes(j))
                                                   for j, c in enumerate(self.cell_order)}})]

    def _cell_params(self, cell: str) -> Tensors:
        return self._subs[cell] if self._subs else self.params

    def _aggregate(self, updates: Mapping[str, CellUpdate]) -> dict[str, Any]:
        assert self.partition is not None
        index = {cell: j for j, cell in enumerate(self.cell_order)}
        new_subs = {index[c]: aggregate.add(self._subs[c], updates[c].delta) for c in sorted(updates)}
        new = reassemble(self.partition, self.params, new_subs)
        if self.optimizer is None:
            return new
        return self._apply(aggregate.subtract(new, self.params))
