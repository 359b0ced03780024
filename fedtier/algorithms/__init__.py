"""Sans-I/O algorithms. Each module has ``Device``, ``Edge`` and ``Cloud`` role classes.

``ALGORITHMS`` maps the name used in configs and task messages to an ``Algorithm``: the module
path of its roles and what the rest of fedtier needs to know about it (its traits). Shells
create roles through ``load(name)``; the rollout config, the coordinator, the fleet runners and
the commands ask ``describe(name)`` rather than compare names, so that adding an algorithm
touches only this table (its roles, its config section). ``tests/unit/test_algorithm_names.py``
keeps comparisons against algorithm names out of every other package.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType

from fedtier.errors import UnexpectedMessageError


@dataclass(frozen=True)
class Algorithm:
    """One algorithm: where its roles live and the traits the code outside its roles depends on.

    A trait is a plain fact about the algorithm ("its cells train disjoint submodels"), not about
    one caller; each says who reads it. The defaults describe an algorithm with none of them.
    """

    module: str
    """Import path of the module with its ``Device``, ``Edge`` and ``Cloud`` roles (``load``)."""
    variant_of: str | None = None
    """The algorithm whose config section selects this one (``secure_fedavg``: ``[fedavg] secure_aggregation``).
    A variant arrives in tasks but is not a value of the rollout's ``algorithm`` (``names`` leaves it out)."""
    scorer: bool = False
    """X-risk: trains a one-output scorer through the loss ``weighted_score`` on a binary task (FeDXL). The
    rollout config requires such a model and refuses ``weighted_score`` elsewhere, privacy and ``label_flip``
    for it; ``cloud_coordinator.rollout.prepare`` builds the scorer and checks the labels; the demo picks a
    rare-event task for it."""
    strategies: bool = False
    """Its tiers combine model changes, so ``[aggregation]``, ``[server_optimizer]`` and ``[edge_optimizer]``
    apply (``fedtier.algorithms.strategies``, ``server_opt``); the rollout config refuses them otherwise."""
    submodels: bool = False
    """Each cell trains a disjoint submodel of the built-in MLP, redrawn every round (HIST): the rollout config
    needs an MLP whose hidden layers split over the cells, a ``mean`` at the cloud and no edge optimizer; the
    coordinator builds one bundle per cell and hands the cloud role the architecture (``arch``); devices hold
    no global model to evaluate (no federated evaluation); the privacy utility estimate counts each cell's
    parameters and does not average the cells' noise; its edges do not sample devices yet."""
    split_model: bool = False
    """Trains its own split model with a host per cell beside the devices (HSGD): ``[model]`` is unused, the
    coordinator prepares hybrid data and split artifacts, the fleet runners start the hosts, the metrics row
    counts the embedding traffic and the paper's values, ``fedtier demo`` runs its own fleet of threads."""
    proximal: bool = False
    """Its section has FedProx's ``proximal_mu`` and ``partial_work`` (the ``--proximal-mu`` and
    ``--partial-work`` options of ``fedtier simulate`` and ``fedtier demo`` refuse the other algorithms)."""
    device_sampling: bool = False
    """Its edges sample devices under ``[privacy] device_sampling`` (the coordinator refuses sampling
    otherwise, before it calibrates the noise)."""
    adaptive_clipping: bool = False
    """Its devices report whether their update was clipped, so ``[privacy] adaptive_clip`` can move the clip
    bound (the rollout config refuses adaptive clipping otherwise)."""
    secure_aggregation: bool = False
    """Its cells can run SecAgg+ (``[fedavg] secure_aggregation`` selects ``secure_fedavg``); ``fedtier demo
    --secure-aggregation`` refuses the other algorithms."""
    replans: bool = False
    """The cloud re-plans every round's settings from what devices measured (QHetFed's (tau, gamma) under
    ``[qhetfed.plan]``: ``RolloutConfig.round_planner``, the cloud role's ``replan``)."""
    quantized: bool = False
    """Its uploads are QSGD-quantized by default (its section's ``bits_device`` and ``bits_edge`` are not 0), so
    ``fedtier demo --bits-device/--bits-edge`` set them. HIST has the settings but sends float32 by default,
    as in its paper."""
    asynchronous: bool = False
    """No rounds: its tiers aggregate buffered updates as they arrive (FedBuff). ``fedtier simulate`` runs it on
    the trace simulator (``local_fleet.trace_sim``: virtual time, device availability and speeds); the MQTT
    shells host it too (an edge keeps every input of the rollout for its replay, the coordinator keeps each update
    under the model version it goes into; its ledger charges each release as made)."""
    local_steps_setting: str = "local_steps"
    """The setting of its section that counts a device's local steps (QHetFed: ``gamma``), which ``fedtier demo
    --local-steps`` sets."""

    @property
    def private(self) -> bool:
        """Its uplinks pass the differential-privacy mechanism: its roles say so (``SUPPORTS_PRIVACY``: a role
        without it refuses a noise plan). The rollout config and ``fedtier demo --privacy`` refuse the others."""
        return bool(importlib.import_module(self.module).Device.SUPPORTS_PRIVACY)


ALGORITHMS: dict[str, Algorithm] = {
    "fedavg": Algorithm("fedtier.algorithms.fedavg", strategies=True, proximal=True, device_sampling=True,
                        adaptive_clipping=True, secure_aggregation=True),
    "hier_qsgd": Algorithm("fedtier.algorithms.hier_qsgd", strategies=True, proximal=True, device_sampling=True,
                           adaptive_clipping=True, quantized=True),
    "qhetfed": Algorithm("fedtier.algorithms.qhetfed", strategies=True, replans=True, quantized=True,
                         local_steps_setting="gamma"),
    "hist": Algorithm("fedtier.algorithms.hist", strategies=True, submodels=True),
    "fedxl": Algorithm("fedtier.algorithms.fedxl", scorer=True),
    "secure_fedavg": Algorithm("fedtier.algorithms.secure_fedavg", variant_of="fedavg", strategies=True,
                               proximal=True, device_sampling=True, secure_aggregation=True),
    "hsgd": Algorithm("fedtier.algorithms.hsgd", split_model=True),
    "fedbuff": Algorithm("fedtier.algorithms.fedbuff", strategies=True, asynchronous=True),
}

_TRAITS = frozenset({f.name for f in dataclasses.fields(Algorithm) if f.type == "bool"} | {"private"})
"""The yes-or-no traits ``names`` can filter by."""


def describe(name: str) -> Algorithm:
    """What ``name`` is; ``UnexpectedMessageError`` if unknown.

    Unknown names arrive from the wire (a task's ``config.algorithm``), hence a remote error.
    """
    algorithm = ALGORITHMS.get(name)
    if algorithm is None:
        raise UnexpectedMessageError(f"unknown algorithm {name!r}; this build knows {sorted(ALGORITHMS)}")
    return algorithm


def load(name: str) -> ModuleType:
    """The algorithm module called ``name``; ``UnexpectedMessageError`` if unknown."""
    return importlib.import_module(describe(name).module)


def names(trait: str | None = None) -> tuple[str, ...]:
    """The algorithms a rollout may name (variants left out), in table order; with ``trait``, those having it.

    For the rollout's ``algorithm`` choices and for messages that list who has a trait
    ("differential privacy covers fedavg, hier_qsgd, hist").
    """
    if trait is not None and trait not in _TRAITS:
        raise ValueError(f"{trait!r} is not a trait of an algorithm ({', '.join(sorted(_TRAITS))})")
    return tuple(name for name, a in ALGORITHMS.items()
                 if a.variant_of is None and (trait is None or getattr(a, trait)))
