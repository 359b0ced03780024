"""Resource limits of the embedded broker, and the byte budget that enforces the total.

One :class:`BrokerLimits` holds every limit with a safe default; ``fedtier``'s Mosquitto
configurations are rendered from the same numbers (``provisioning.broker_config``), so both
brokers as fedtier configures them refuse the same things (docs/broker.md lists them).

Why each exists (a peer that is not yet a client must not be able to cost memory):

* ``max_packet_size`` — any packet; announced to v5 clients in CONNACK (MQTT 5 §3.2.2.3.6).
  fedtier's transport chunks larger messages under it.
* ``max_connect_size`` — anything read before CONNECT is accepted: a peer that has not
  identified itself may announce at most this much, checked on the fixed header, before its
  body is read.
* ``max_buffered_bytes`` — the total held for clients: partial packets still arriving,
  messages queued in sessions and retained messages. Over it, the connection that asks for
  more is closed (reason 0x97 Quota exceeded), a queued message is dropped, a retained
  publish is refused.
* ``input_allowance`` / ``max_input_bytes`` — partial packets, which any connected client can
  leave half sent for as long as its socket stays open. Each connection may hold
  ``input_allowance`` of one without asking; beyond that its bytes come out of a total,
  ``max_input_bytes``, shared by all connections. A read never takes more from a socket than
  the connection may hold, so a connection the total cannot serve is not read (its bytes wait
  in the kernel, TCP tells the client to wait) until bytes are given back; if the total is
  held by packets begun more than ``stall_timeout`` seconds ago, those connections are closed
  (0x97) to serve the one waiting. At most ``max_connections`` x ``input_allowance`` +
  ``max_input_bytes`` (48 MiB by default) of partial packets, however many clients stall.
* ``max_keepalive`` — Mosquitto's option of the same name: a v5 client that asks for no
  keep-alive (0) or a longer one is told this one in CONNACK (Server Keep Alive) and held to
  it. A 3.1.1 client that asks for none is closed after 1.5 x this long without a packet
  (Mosquitto keeps those forever), so silent clients cannot hold every connection slot.
* ``max_queued_messages`` / ``max_queued_bytes`` — per session, the QoS 1/2 messages waiting
  beyond the in-flight window (Mosquitto's options of the same names); the oldest is dropped.
* ``max_output_backlog`` — per connection, unsent output: above it QoS 0 messages to that
  client are dropped and QoS 1/2 messages wait in the session.
* ``max_connections`` / ``max_connections_per_address`` — sockets. When one is reached, a new
  socket takes the place of the oldest connection that has not completed CONNECT (from the
  same address, for the per-address limit); with none, the new socket is closed at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fedtier.errors import ConfigError

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


@dataclass(frozen=True, slots=True)
class BrokerLimits:
    """The broker's limits. ``max_packet_size=None`` means no packet limit (not a default)."""

    max_packet_size: int | None = 1 * MIB
    max_connect_size: int = 64 * KIB
    max_buffered_bytes: int = 256 * MIB
    max_queued_messages: int = 10_000
    max_queued_bytes: int = 64 * MIB
    max_output_backlog: int = 8 * MIB
    max_connections: int = 1024
    max_connections_per_address: int = 256
    max_input_bytes: int = 32 * MIB
    input_allowance: int = 16 * KIB
    stall_timeout: int = 10
    """Seconds: a partial packet begun longer ago may be closed when ``max_input_bytes`` runs out."""
    max_keepalive: int = 300
    """Seconds; the keep-alive imposed on clients that ask for none (see the module docstring)."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is None and spec.name == "max_packet_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{spec.name} must be a positive integer, got {value!r}", key=spec.name)
        if self.max_packet_size is not None and self.max_packet_size < 64:
            raise ConfigError("max_packet_size must be at least 64 bytes", key="max_packet_size")
        if self.max_connect_size < 64:
            raise ConfigError("max_connect_size must be at least 64 bytes", key="max_connect_size")
        if self.max_keepalive > 65_535:
            raise ConfigError("max_keepalive must be at most 65535 seconds", key="max_keepalive")
        if self.max_connections_per_address > self.max_connections:
            raise ConfigError("max_connections_per_address exceeds max_connections",
                              key="max_connections_per_address")

    @property
    def max_input_held(self) -> int:
        """The most partial packets can hold in all: every connection's allowance plus the shared total."""
        return self.max_connections * self.input_allowance + self.max_input_bytes

    @property
    def connect_limit(self) -> int:
        """What a peer may announce before its CONNECT is accepted (never above the packet limit)."""
        if self.max_packet_size is None:
            return self.max_connect_size
        return min(self.max_connect_size, self.max_packet_size)


DEFAULT_LIMITS = BrokerLimits()


class ByteBudget:
    """A shared allowance of bytes: callers take before holding and give back after.

    Plain bookkeeping, no I/O; every caller runs on the broker's event-loop thread.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.refusals = 0

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes; False (and nothing reserved) if that would exceed the limit."""
        if n <= 0:
            return True
        if self.used + n > self.limit:
            self.refusals += 1
            return False
        self.used += n
        return True

    def force(self, n: int) -> None:
        """Reserve ``n`` bytes even past the limit (a caller that has already received them)."""
        self.used += max(0, n)

    def give_back(self, n: int) -> None:
        self.used = max(0, self.used - n)

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)


class MessageHolds:
    """Reference-counted holds of message payloads against a :class:`ByteBudget`.

    One message queued for many sessions (and perhaps retained) is one payload in memory, so
    it is charged once, on the first hold, and released with the last.
    """

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self._held: dict[int, tuple[object, int, int]] = {}  # id -> (message, size, count)

    def hold(self, message: object, size: int) -> bool:
        key = id(message)
        entry = self._held.get(key)
        if entry is not None:
            self._held[key] = (message, size, entry[2] + 1)
            return True
        if not self.budget.take(size):
            return False
        self._held[key] = (message, size, 1)
        return True

    def release(self, message: object) -> None:
        key = id(message)
        entry = self._held.get(key)
        if entry is None:
            return
        held, size, count = entry
        if count > 1:
            self._held[key] = (held, size, count - 1)
        else:
            del self._held[key]
            self.budget.give_back(size)

    @property
    def count(self) -> int:
        """Distinct messages held."""
        return len(self._held)


class ConnectionGate:
    """Counts open sockets in total and per peer address; refuses those over the limits."""

    def __init__(self, limits: BrokerLimits) -> None:
        self._limits = limits
        self._per_address: dict[str, int] = {}
        self.total = 0

    def admit(self, address: str) -> str | None:
        """Count a new socket from ``address``; return why it is refused (nothing counted) or None."""
        if self.total >= self._limits.max_connections:
            return f"max_connections ({self._limits.max_connections}) reached"
        if self._per_address.get(address, 0) >= self._limits.max_connections_per_address:
            return (f"max_connections_per_address ({self._limits.max_connections_per_address}) "
                    f"reached for {address}")
        self._per_address[address] = self._per_address.get(address, 0) + 1
        self.total += 1
        return None

    def leave(self, address: str) -> None:
        count = self._per_address.get(address, 0)
        if count <= 1:
            self._per_address.pop(address, None)
        else:
            self._per_address[address] = count - 1
        self.total = max(0, self.total - 1)
