"""The resource limits of fedtier's Mosquitto configurations, from the embedded broker's numbers.

Every ``mosquitto.conf`` fedtier writes (``provisioning.broker_config``, ``fedtier demo``, the
tests' brokers) takes its limits from here, and here they come from
:class:`fedtier.embedded_broker.limits.BrokerLimits`, so both brokers refuse the same things.
What maps to what in Mosquitto 2.0 (``mosquitto.conf(5)``; docs/broker.md has the table):

* ``max_packet_size`` — Mosquitto checks it on the fixed header of *every* packet, CONNECT
  included, so it is also Mosquitto's only limit on what a peer may announce before CONNECT
  (2.0 has no separate one; without it, 2.0.11 buffers a CONNECT announcing 256 MiB).
* ``max_queued_messages`` / ``max_queued_bytes`` — the same options.
* ``max_buffered_bytes`` → ``memory_limit``: Mosquitto's cap on its whole heap (in Debian's
  build; a build without memory tracking ignores it). Over it, the client whose message or
  packet cannot be allocated is disconnected.
* ``max_connections`` — a *listener* option in Mosquitto, hence a separate list of lines.
* ``max_connections_per_address``, ``max_connect_size``, ``max_output_backlog`` have no
  Mosquitto 2.0 option: per-address limits belong in the firewall there (docs/broker.md).
"""

from __future__ import annotations

from dataclasses import replace

from fedtier.embedded_broker.limits import DEFAULT_LIMITS, BrokerLimits


def limits_for(max_packet_size: int | None = None, base: BrokerLimits = DEFAULT_LIMITS) -> BrokerLimits:
    """``base`` with its packet limit replaced when one is given (``None`` or 0: keep it)."""
    return replace(base, max_packet_size=max_packet_size) if max_packet_size else base


def mosquitto_global_limits(limits: BrokerLimits = DEFAULT_LIMITS) -> list[str]:
    """The global ``mosquitto.conf`` lines of ``limits`` (before any ``listener``)."""
    lines = ["# Resource limits (fedtier defaults, docs/broker.md). max_packet_size is checked on every",
             "# packet's header, CONNECT included: nothing larger is ever buffered."]
    if limits.max_packet_size is not None:
        lines.append(f"max_packet_size {limits.max_packet_size}")
    lines += [f"max_queued_messages {limits.max_queued_messages}",
              f"max_queued_bytes {limits.max_queued_bytes}",
              f"memory_limit {limits.max_buffered_bytes}"]
    return lines


def mosquitto_listener_limits(limits: BrokerLimits = DEFAULT_LIMITS) -> list[str]:
    """The lines of ``limits`` that Mosquitto scopes to a listener (after its ``listener`` line)."""
    return [f"max_connections {limits.max_connections}"]
