"""Hierarchical FedAvg: local SGD on devices, averaging in each cell, cells averaged by size.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (AISTATS 2017), arranged in two tiers (Liu et al., "Client-Edge-Cloud Hierarchical
Federated Learning", ICC 2020). It is Hier-Local-QSGD (``hier_qsgd``) with identity
quantizers — seed 003 §2.3: "plain hierarchical FedAvg is Hier-Local-QSGD with Q1 = Q2 =
identity" — so it runs the same roles; only the configuration differs.

Round ``t``, with global parameters ``w_t`` and the default ``edge_rounds = 1``:

1. cloud  -> edge  ``CellTask(t, w_t, members, config)``            (every cell)
2. edge   -> cell  ``DeviceTask(t, w_t, config)``                   (broadcast)
3. device: ``local_steps`` SGD steps from ``w_t``; sends ``DeviceUpdate(t, w_i - w_t, n_i)``
4. edge: once every member reported (or the deadline passed with a quorum),
   ``delta_c = sum_i a_i delta_i / sum_i a_i`` with ``a_i = 1`` or ``n_i``; ``CellUpdate``
   with weight ``sum_i a_i``
5. cloud: ``w_{t+1} = w_t + sum_c W_c delta_c / sum_c W_c`` — the flat weighted average over
   all reporting devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedtier.algorithms.cloud import Cloud
from fedtier.algorithms.common import quorum_count
from fedtier.algorithms.hier_qsgd import Device, Edge, HierConfig
from fedtier.errors import LocalProtocolError

NAME = "fedavg"

__all__ = ["FedAvgConfig", "Device", "Edge", "Cloud", "quorum_count", "NAME"]


@dataclass(frozen=True, slots=True)
class FedAvgConfig(HierConfig):
    """``HierConfig`` without quantization (``bits_device = bits_edge = 0``)."""

    ALGORITHM: ClassVar[str] = NAME

    def __post_init__(self) -> None:
        HierConfig.__post_init__(self)
        if self.bits_device or self.bits_edge:
            raise LocalProtocolError("fedavg sends float32; use hier_qsgd for quantized uploads")
