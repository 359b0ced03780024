"""The embedded broker's limits, byte budget and connection gate, without sockets."""

from __future__ import annotations

import pytest

from fedtier.embedded_broker.limits import KIB, MIB, BrokerLimits, ByteBudget, ConnectionGate, MessageHolds
from fedtier.errors import ConfigError
from provisioning.broker_limits import limits_for, mosquitto_global_limits, mosquitto_listener_limits


@pytest.mark.parametrize("key, value", [("max_packet_size", 0), ("max_connections", -1),
                                        ("max_queued_bytes", 0), ("max_connect_size", 10),
                                        ("max_packet_size", 63), ("max_output_backlog", True)])
def test_invalid_limits_name_the_key(key: str, value: int) -> None:
    with pytest.raises(ConfigError) as info:
        BrokerLimits(**{key: value})  # type: ignore[arg-type]
    assert info.value.key == key


def test_per_address_cannot_exceed_the_total() -> None:
    with pytest.raises(ConfigError) as info:
        BrokerLimits(max_connections=10, max_connections_per_address=11)
    assert info.value.key == "max_connections_per_address"


def test_the_pre_connect_limit_never_exceeds_the_packet_limit() -> None:
    assert BrokerLimits().connect_limit == 64 * KIB
    assert BrokerLimits(max_packet_size=4 * KIB).connect_limit == 4 * KIB
    assert BrokerLimits(max_packet_size=None).connect_limit == 64 * KIB


def test_budget_refuses_what_does_not_fit_and_counts_it() -> None:
    budget = ByteBudget(100)
    assert budget.take(60) and not budget.take(41) and budget.take(40)
    assert (budget.used, budget.refusals) == (100, 1)
    budget.give_back(100)
    assert budget.used == 0


def test_a_message_held_many_times_is_charged_once() -> None:
    budget = ByteBudget(100)
    holds = MessageHolds(budget)
    message, other = object(), object()
    assert holds.hold(message, 80) and holds.hold(message, 80) and holds.hold(message, 80)
    assert budget.used == 80 and holds.count == 1
    assert not holds.hold(other, 30)  # 80 + 30 > 100
    holds.release(message)
    holds.release(message)
    assert budget.used == 80
    holds.release(message)
    assert budget.used == 0 and holds.count == 0
    holds.release(message)  # releasing what is not held is harmless
    assert budget.used == 0


def test_gate_counts_per_address_and_in_total() -> None:
    gate = ConnectionGate(BrokerLimits(max_connections=3, max_connections_per_address=2))
    assert gate.admit("10.0.0.1") is None and gate.admit("10.0.0.1") is None
    assert "per_address" in str(gate.admit("10.0.0.1"))
    assert gate.admit("10.0.0.2") is None
    assert "max_connections (3)" in str(gate.admit("10.0.0.3"))
    gate.leave("10.0.0.1")
    assert gate.admit("10.0.0.3") is None and gate.total == 3


def test_mosquitto_lines_come_from_the_same_limits() -> None:
    lines = mosquitto_global_limits(limits_for(4096))
    assert "max_packet_size 4096" in lines
    assert f"max_queued_bytes {64 * MIB}" in lines and f"memory_limit {256 * MIB}" in lines
    assert "max_queued_messages 10000" in lines
    assert mosquitto_listener_limits() == ["max_connections 1024"]
    assert f"max_packet_size {MIB}" in mosquitto_global_limits()
    assert not any(line.startswith("max_packet_size") for line in
                   mosquitto_global_limits(BrokerLimits(max_packet_size=None)))


def test_budget_force_and_available() -> None:
    budget = ByteBudget(100)
    budget.force(120)  # bytes already received are charged even past the limit
    assert (budget.used, budget.available) == (120, 0)
    budget.give_back(50)
    assert budget.available == 30
