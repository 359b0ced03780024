"""Disjoint submodels of an MLP by partitioning its hidden neurons (HIST, seed 002 §3).

Every global round the cloud draws, for each partitioned hidden layer, a random split of its
neurons into one index set per cell (sizes differ by at most one; each set sorted, so with a
single cell the submodel *is* the full model). Cell ``j``'s submodel is the physically smaller
network on its neurons:

* ``fc{i}.weight`` (shape ``[d_{i+1}, d_i]``) keeps the rows of cell ``j``'s neurons when layer
  ``i+1`` is partitioned, the columns when layer ``i`` is; ``fc{i}.bias`` follows its rows.
* Hidden layers are partitioned alternately (1, 3, 5, ...), so no matrix is ever split along
  both dimensions — otherwise the off-diagonal blocks would belong to no cell, breaking the
  covering condition of Eq. (3) (digest §3.3).
* Tensors touched by no partition (the output bias of a one-hidden-layer net; the layers
  around an unpartitioned hidden layer) are **shared**: sent to every cell and averaged
  uniformly across cells when the model is reassembled. Strict Eq. (3) would give each to one
  cell; averaging is the authors' choice for shared CNN layers and costs only those floats
  (digest §3.2 — the deliberate deviation this toolkit makes).

Reassembly (Eq. (6)) copies each cell's partitioned slices back into place — a masked sum, not
an average — so with unchanged submodels it rebuilds the previous model bit for bit. Only the
cloud holds a ``Partition``; edges and devices work in submodel coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from fedtier.errors import LocalProtocolError
from fedtier.training.layout import ArchSpec

Tensors = Mapping[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class MlpPlan:
    """Which hidden layers of an MLP (``sizes = [d_0, ..., d_L]``) are partitioned."""

    sizes: tuple[int, ...]
    partitioned: tuple[int, ...]

    @property
    def layers(self) -> int:
        return len(self.sizes) - 1

    def weight_split(self, i: int) -> str | None:
        """How ``fc{i}.weight`` is split: "rows", "cols", or ``None`` (shared)."""
        if i + 1 in self.partitioned:
            return "rows"
        if i in self.partitioned:
            return "cols"
        return None

    def shared_names(self) -> tuple[str, ...]:
        """Tensors every cell receives whole (averaged across cells at reassembly)."""
        names = []
        for i in range(self.layers):
            if self.weight_split(i) is None:
                names.append(f"fc{i}.weight")
            if i + 1 not in self.partitioned:
                names.append(f"fc{i}.bias")
        return tuple(names)


def plan_for(arch: ArchSpec, cells: int) -> MlpPlan:
    """The partition plan of ``arch`` for ``cells`` cells.

    Raises:
        LocalProtocolError: not an MLP, no hidden layer, or a partitioned layer with fewer
            neurons than cells (every submodel needs at least one).
    """
    if arch.kind != "mlp":
        raise LocalProtocolError(f"submodel partitioning needs an MLP, not {arch.kind!r}")
    sizes = tuple(int(d) for d in arch.options["sizes"])
    if len(sizes) < 3:
        raise LocalProtocolError("submodel partitioning needs at least one hidden layer")
    partitioned = tuple(range(1, len(sizes) - 1, 2))
    for k in partitioned:
        if sizes[k] < cells:
            raise LocalProtocolError(f"hidden layer {k} has {sizes[k]} neurons, fewer than the {cells} cells")
    return MlpPlan(sizes=sizes, partitioned=partitioned)


@dataclass(frozen=True, slots=True, eq=False)
class Partition:
    """Per partitioned hidden layer, one sorted index array per cell (cell order = ``cells``)."""

    plan: MlpPlan
    parts: Mapping[int, tuple[np.ndarray, ...]]

    @property
    def cells(self) -> int:
        return len(next(iter(self.parts.values())))

    def sizes(self, cell: int) -> tuple[int, ...]:
        """The submodel's layer sizes for cell index ``cell``."""
        return tuple(len(self.parts[k][cell]) if k in self.parts else d for k, d in enumerate(self.plan.sizes))

    def describe(self) -> dict[str, list[list[int]]]:
        """Plain data (for logs): layer -> per-cell index lists."""
        return {str(k): [p.tolist() for p in ps] for k, ps in self.parts.items()}


def draw(plan: MlpPlan, cells: int, rng: np.random.Generator) -> Partition:
    """A fresh random partition: ``np.array_split`` of a permutation, each part sorted (digest §3.4)."""
    parts = {k: tuple(np.sort(p) for p in np.array_split(rng.permutation(plan.sizes[k]), cells))
             for k in plan.partitioned}
    return Partition(plan=plan, parts=parts)


def fixed_sizes(plan: MlpPlan, cells: int) -> list[tuple[int, ...]]:
    """Submodel layer sizes per cell index; the same for every draw (``array_split`` sizes)."""
    out = []
    for j in range(cells):
        out.append(tuple((d // cells + (1 if j < d % cells else 0)) if k in plan.partitioned else d
                         for k, d in enumerate(plan.sizes)))
    return out


def submodel_arch(plan: MlpPlan, sizes: Sequence[int]) -> ArchSpec:
    return ArchSpec("mlp", {"sizes": [int(d) for d in sizes]})


def _index(part: Partition, cell: int, layer: int) -> np.ndarray | slice:
    return part.parts[layer][cell] if layer in part.parts else slice(None)


def extract(part: Partition, cell: int, params: Tensors) -> dict[str, np.ndarray]:
    """Cell ``cell``'s submodel parameters (copies), named like the full model's."""
    out: dict[str, np.ndarray] = {}
    for i in range(part.plan.layers):
        rows, cols = _index(part, cell, i + 1), _index(part, cell, i)
        w = params[f"fc{i}.weight"]
        out[f"fc{i}.weight"] = np.array(w[rows][:, cols], dtype=np.float32)
        out[f"fc{i}.bias"] = np.array(params[f"fc{i}.bias"][rows], dtype=np.float32)
    return out


def reassemble(part: Partition, params: Tensors, subs: Mapping[int, Tensors]) -> dict[str, np.ndarray]:
    """Eq. (6): copy each reporting cell's partitioned slices into the model; average the shared
    tensors uniformly over the reporting cells. Cells missing from ``subs`` keep their old values.
    """
    if not subs:
        raise LocalProtocolError("reassemble needs at least one submodel")
    out = {n: np.array(p, dtype=np.float32, copy=True) for n, p in params.items()}
    shared = set(part.plan.shared_names())
    cells = sorted(subs)
    for i in range(part.plan.layers):
        w_name, b_name = f"fc{i}.weight", f"fc{i}.bias"
        for cell in cells:
            rows, cols = _index(part, cell, i + 1), _index(part, cell, i)
            if w_name not in shared:
                if isinstance(rows, slice):
                    out[w_name][:, cols] = subs[cell][w_name]
                else:
                    out[w_name][rows] = subs[cell][w_name]
            if b_name not in shared:
                out[b_name][rows] = subs[cell][b_name]
    for name in shared:
        stacked = np.stack([subs[c][name].astype(np.float64) for c in cells])
        out[name] = stacked.mean(axis=0).astype(np.float32)
    return out


def forward(params: Tensors, x: np.ndarray, layers: int) -> np.ndarray:
    """Logits of a ReLU MLP in float64 (a reference for tests and docs)."""
    h = np.asarray(x, dtype=np.float64)
    for i in range(layers):
        h = h @ params[f"fc{i}.weight"].astype(np.float64).T + params[f"fc{i}.bias"].astype(np.float64)
        if i < layers - 1:
            h = np.maximum(h, 0.0)
    return h
