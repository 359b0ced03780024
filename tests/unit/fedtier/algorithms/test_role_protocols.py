"""Every role of every algorithm honours the protocol its shell talks to, and refuses every verb after an error.

mypy checks the protocols statically (``fedtier/algorithms/conformance.py``); these tests check the same at
runtime, that the conformance table covers every algorithm a shell can load, and the ``ERROR`` promise of
``fedtier.algorithms.base`` for each class: once a verb raised ``LocalProtocolError``, every verb raises.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np
import pytest

from fedtier.algorithms import ALGORITHMS, load
from fedtier.algorithms.base import (
    GUARDED,
    QUERIES,
    VERBS,
    CloudRole,
    DeviceRole,
    EdgeRole,
    GradientResult,
    LocalResult,
    RoleState,
    RowScores,
)
from fedtier.algorithms.common import RoundSettings
from fedtier.algorithms.conformance import ROLE_CLASSES
from fedtier.errors import LocalProtocolError
from fedtier.training.layout import ArchSpec

ARCH = ArchSpec("mlp", {"sizes": [4, 8, 2]})
PARAMS = {"fc0.weight": np.zeros((8, 4), np.float32), "fc0.bias": np.zeros(8, np.float32),
          "fc1.weight": np.zeros((2, 8), np.float32), "fc1.bias": np.zeros(2, np.float32)}
CELLS = {"cell-a": ("dev-0", "dev-1")}

TIERS: list[tuple[str, str, type]] = [(name, tier, protocol) for name in sorted(ROLE_CLASSES)
                                      for tier, protocol in (("device", DeviceRole), ("edge", EdgeRole),
                                                             ("cloud", CloudRole), ("host", DeviceRole))
                                      if getattr(ROLE_CLASSES[name], tier) is not None]


def protocol_members(protocol: type) -> dict[str, Any]:
    """The members a protocol declares (its own and its protocol bases'), name -> function or property."""
    out: dict[str, Any] = {}
    for base in reversed(protocol.__mro__):
        if getattr(base, "_is_protocol", False) and base.__module__ != "typing":
            out.update({k: v for k, v in vars(base).items() if not k.startswith("_")})
    return out


def config_of(name: str) -> RoundSettings:
    module = load(name)
    [cls] = {v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, RoundSettings) and v.ALGORITHM == module.NAME}
    return cls(hosts={"cell-a": "dev-1"}) if name == "hsgd" else cls()


def build(name: str, tier: str) -> Any:
    """A fresh role of ``name``'s ``tier``, as a shell builds it."""
    cls = getattr(ROLE_CLASSES[name], tier)
    if tier == "device":
        return cls(device_id="dev-0", cell="cell-a", rollout="r")
    if tier == "host":
        return cls(host_id="dev-1", cell="cell-a", rollout="r")
    if tier == "edge":
        return cls(cell="cell-a", rollout="r")
    extra = {"arch": ARCH} if name == "hist" else {}
    return cls(rollout="r", cells=CELLS, initial_params=PARAMS, config=config_of(name), rounds=2, **extra)


class Exploding:
    """What no shell should hand a role: every attribute read fails locally (a bug in the caller)."""

    def __getattr__(self, name: str) -> Any:
        raise LocalProtocolError(f"read {name} of something that is not a decoded message")


CALLS: dict[str, Callable[[Any], Any]] = {
    "receive": lambda r: r.receive(Exploding(), 0.0),
    "tick": lambda r: r.tick(0.0),
    "start": lambda r: r.start(0.0),
    "resend": lambda r: r.resend("dev-0", 0.0),
    "trained": lambda r: r.trained(0, LocalResult(delta={}, num_samples=1, mean_loss=0.0, steps=1)),
    "gradient_done": lambda r: r.gradient_done(0, 0, GradientResult(grad={}, loss=0.0, num_samples=1)),
    "evaluated": lambda r: r.evaluated(0, None),
    "scored": lambda r: r.scored(0, 0, RowScores(rows={}, outputs={}, num_samples=1)),
    "embedded": lambda r: r.embedded(0, 0, np.zeros((1, 1), np.float32)),
    "split_trained": lambda r: r.split_trained(0, 0, {}, 0.0),
    "failed": lambda r: r.failed(0, 0, "crash"),
    "load_strategy_state": lambda r: r.load_strategy_state({}),
}
"""One call of each verb; in ``ERROR`` the arguments never matter."""


def misuse(role: Any, tier: str) -> None:
    """The tier's own misuse: a result of work nobody asked for (device tier), a second start (cloud)."""
    if tier == "cloud":
        role.start(0.0)
        role.start(0.0)
    else:
        role.trained(0, LocalResult(delta={}, num_samples=1, mean_loss=0.0, steps=1))


def test_every_algorithm_a_shell_can_load_is_checked_with_the_classes_it_loads() -> None:
    assert set(ROLE_CLASSES) == set(ALGORITHMS)
    for name, classes in ROLE_CLASSES.items():
        module = load(name)
        assert (classes.device, classes.edge, classes.cloud) == (module.Device, module.Edge, module.Cloud)
        assert classes.host is getattr(module, "Host", None)


def test_every_protocol_method_is_a_verb_or_a_query() -> None:
    methods = {name for protocol in (DeviceRole, EdgeRole, CloudRole)
               for name, member in protocol_members(protocol).items() if inspect.isfunction(member)}
    assert methods == VERBS | QUERIES and not VERBS & QUERIES


@pytest.mark.parametrize("name,tier,protocol", TIERS)
def test_every_role_implements_its_protocol_at_runtime(name: str, tier: str, protocol: type) -> None:
    role = build(name, tier)
    assert isinstance(role, protocol)
    for member, declared in protocol_members(protocol).items():
        if inspect.isfunction(declared):
            ours = inspect.signature(getattr(type(role), member))
            assert list(ours.parameters) == list(inspect.signature(declared).parameters), (member, ours)


@pytest.mark.parametrize("name,tier,protocol", TIERS)
def test_every_verb_of_every_role_is_guarded(name: str, tier: str, protocol: type) -> None:
    cls = getattr(ROLE_CLASSES[name], tier)
    verbs = VERBS & set(protocol_members(protocol))
    assert verbs and all(getattr(getattr(cls, verb), GUARDED, False) for verb in verbs)


@pytest.mark.parametrize("name,tier,protocol", TIERS)
def test_transition_tables_map_states_to_states_and_never_name_error(name: str, tier: str, protocol: type) -> None:
    table = getattr(ROLE_CLASSES[name], tier).TRANSITIONS
    targets = {target for row in table.values() for target in row.values()}
    assert table and set(table) | targets <= set(RoleState)
    assert RoleState.ERROR not in set(table) | targets  # entered by the verbs' guard alone
    assert all(isinstance(event, str) for row in table.values() for event in row)


@pytest.mark.parametrize("how", ["own misuse", "local failure inside a verb"])
@pytest.mark.parametrize("name,tier,protocol", TIERS)
def test_after_a_misuse_every_verb_raises(name: str, tier: str, protocol: type, how: str) -> None:
    role = build(name, tier)
    with pytest.raises(LocalProtocolError):
        if how == "own misuse" and tier != "edge":  # an edge's verbs take only its peers' input
            misuse(role, tier)
        else:
            role.receive(Exploding(), 0.0)
    assert role.state is RoleState.ERROR
    for verb in sorted(VERBS & set(protocol_members(protocol))):
        with pytest.raises(LocalProtocolError, match="ERROR"):
            CALLS[verb](role)
    assert role.state is RoleState.ERROR
    if tier in ("edge", "cloud"):  # queries still answer: a shell can say where a failed role stood
        assert role.overdue(0.0) == ()
        role.strategy_state()
