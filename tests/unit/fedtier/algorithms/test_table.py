"""The algorithm table (``fedtier.algorithms``): lookups, and traits that agree with the roles and the sections."""

from __future__ import annotations

import dataclasses

import pytest

from fedtier import algorithms
from fedtier.errors import UnexpectedMessageError
from fedtier.rollout.config import RolloutConfig

CHOICES = algorithms.names()


def _section(name: str) -> object:
    """The default section of ``name`` in a rollout config."""
    return getattr(RolloutConfig(algorithm=name), name)


@pytest.mark.parametrize("name", sorted(algorithms.ALGORITHMS))
def test_every_name_loads_its_roles(name: str) -> None:
    module = algorithms.load(name)
    assert module.__name__ == algorithms.describe(name).module
    assert module.NAME == name
    assert all(hasattr(module, role) for role in ("Device", "Edge", "Cloud"))


def test_an_unknown_name_from_the_wire_is_a_remote_error() -> None:
    for lookup in (algorithms.load, algorithms.describe):
        with pytest.raises(UnexpectedMessageError, match="unknown algorithm 'nope'"):
            lookup("nope")


def test_the_rollout_chooses_among_the_table_without_its_variants() -> None:
    assert CHOICES == ("fedavg", "hier_qsgd", "qhetfed", "hist", "fedxl", "hsgd", "fedbuff")
    field = next(f for f in dataclasses.fields(RolloutConfig) if f.name == "algorithm")
    assert tuple(field.metadata["choices"]) == CHOICES
    for name, algorithm in algorithms.ALGORITHMS.items():
        assert (algorithm.variant_of is None) == (name in CHOICES)
        assert algorithm.variant_of is None or algorithm.variant_of in CHOICES


def test_names_lists_who_has_a_trait_and_refuses_a_misspelt_one() -> None:
    assert algorithms.names("private") == ("fedavg", "hier_qsgd", "hist", "fedbuff")
    assert algorithms.names("scorer") == ("fedxl",)
    assert algorithms.names("strategies") == ("fedavg", "hier_qsgd", "qhetfed", "hist", "fedbuff")
    assert algorithms.names("asynchronous") == ("fedbuff",)
    with pytest.raises(ValueError, match="not a trait"):
        algorithms.names("privat")


@pytest.mark.parametrize("name", sorted(algorithms.ALGORITHMS))
def test_private_is_what_the_roles_say(name: str) -> None:
    module = algorithms.load(name)
    roles = [getattr(module, r) for r in ("Device", "Edge", "Host") if hasattr(module, r)]
    assert {bool(r.SUPPORTS_PRIVACY) for r in roles} == {algorithms.describe(name).private}


@pytest.mark.parametrize("name", CHOICES)
def test_the_traits_agree_with_the_config_sections(name: str) -> None:
    traits, section = algorithms.describe(name), _section(name)
    fields = {f.name for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    assert traits.proximal == ({"proximal_mu", "partial_work"} <= fields)
    # A section may name secure_aggregation only to refuse it with its reason (fedbuff's asynchronous buffer).
    refused = getattr(section, "REFUSES_SECURE_AGGREGATION", None) is not None
    assert traits.secure_aggregation == ("secure_aggregation" in fields and not refused)
    assert traits.replans == ("plan" in fields)
    assert traits.quantized == (int(getattr(section, "bits_device", 0)) > 0)
    if not traits.split_model:  # HSGD's devices run P = Q iterations of its own; the demo has its own options
        assert traits.local_steps_setting in fields


def test_hist_edge_refuses_an_edge_optimizer_through_its_own_role() -> None:
    from fedtier.algorithms import hier_qsgd, hist

    assert issubclass(hist.Edge, hier_qsgd.Edge)
    assert hier_qsgd.Edge.EDGE_OPTIMIZER_REFUSAL is None
    assert hist.Edge.EDGE_OPTIMIZER_REFUSAL is not None and "hist redraws" in hist.Edge.EDGE_OPTIMIZER_REFUSAL
