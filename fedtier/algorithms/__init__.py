"""Sans-I/O algorithms. Each module has ``Device``, ``Edge`` and ``Cloud`` role classes.

``ALGORITHMS`` maps the name used in configs and task messages to the module path; shells
create roles through ``load(name)`` so that adding an algorithm touches only this table.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from fedtier.errors import UnexpectedMessageError

ALGORITHMS: dict[str, str] = {
    "fedavg": "fedtier.algorithms.fedavg",
    "hier_qsgd": "fedtier.algorithms.hier_qsgd",
    "qhetfed": "fedtier.algorithms.qhetfed",
    "hist": "fedtier.algorithms.hist",
    "fedxl": "fedtier.algorithms.fedxl",
    "secure_fedavg": "fedtier.algorithms.secure_fedavg",
    "hsgd": "fedtier.algorithms.hsgd",
}


def load(name: str) -> ModuleType:
    """The algorithm module called ``name``; ``UnexpectedMessageError`` if unknown.

    Unknown names arrive from the wire (a task's ``config.algorithm``), hence a remote error.
    """
    path = ALGORITHMS.get(name)
    if path is None:
        raise UnexpectedMessageError(f"unknown algorithm {name!r}; this build knows {sorted(ALGORITHMS)}")
    return importlib.import_module(path)
