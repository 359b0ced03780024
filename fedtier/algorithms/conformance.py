"""Every algorithm's role classes, typed by the protocols the shells talk to.

The shells create roles by name (``load(name).Device(...)``), which a type checker cannot follow:
the module comes back as a ``ModuleType``. So this module names each algorithm's classes once
more, each typed by its protocol (``fedtier.algorithms.base``): mypy, which the suite runs over
the packages, fails here when a role loses a verb, or a verb's signature stops matching what the
shells call. The unit tests check that every name in ``ALGORITHMS`` is here, with the classes
``load`` gives, and that each class honours its protocol at runtime too.

Nothing imports this module at runtime except those tests: a node loads only its own algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from fedtier.algorithms import fedavg, fedbuff, fedxl, hier_qsgd, hist, hsgd, qhetfed, secure_fedavg
from fedtier.algorithms.base import CloudRole, DeviceRole, EdgeRole


@dataclass(frozen=True, slots=True)
class RoleClasses:
    """One algorithm's role classes (``load(name).Device``, ``.Edge``, ``.Cloud``, and HSGD's ``.Host``)."""

    device: type[DeviceRole]
    edge: type[EdgeRole]
    cloud: type[CloudRole]
    host: type[DeviceRole] | None = None
    """The feature party of a cell (HSGD): hosted by a device shell, so a ``DeviceRole`` too."""


ROLE_CLASSES: Mapping[str, RoleClasses] = {
    fedavg.NAME: RoleClasses(device=fedavg.Device, edge=fedavg.Edge, cloud=fedavg.Cloud),
    hier_qsgd.NAME: RoleClasses(device=hier_qsgd.Device, edge=hier_qsgd.Edge, cloud=hier_qsgd.Cloud),
    qhetfed.NAME: RoleClasses(device=qhetfed.Device, edge=qhetfed.Edge, cloud=qhetfed.Cloud),
    hist.NAME: RoleClasses(device=hist.Device, edge=hist.Edge, cloud=hist.Cloud),
    fedxl.NAME: RoleClasses(device=fedxl.Device, edge=fedxl.Edge, cloud=fedxl.Cloud),
    secure_fedavg.NAME: RoleClasses(device=secure_fedavg.Device, edge=secure_fedavg.Edge, cloud=secure_fedavg.Cloud),
    hsgd.NAME: RoleClasses(device=hsgd.Device, edge=hsgd.Edge, cloud=hsgd.Cloud, host=hsgd.Host),
    fedbuff.NAME: RoleClasses(device=fedbuff.Device, edge=fedbuff.Edge, cloud=fedbuff.Cloud),
}
"""Algorithm name (as in ``ALGORITHMS``) -> its role classes."""
