"""A pure-Python MQTT broker for machines without Mosquitto (``fedtier demo`` falls back to it).

Standard library only. It speaks MQTT 3.1.1 and 5.0 with QoS 0 and 1, retained messages,
wills, ``+``/``#`` wildcards, persistent in-memory sessions with offline queueing, the
client's Receive Maximum window and both directions of Maximum Packet Size. Deliberately
absent: QoS 2, TLS, authentication/authorisation, shared subscriptions, topic aliases,
Will Delay, persistence to disk.

Layout, h11-style: :mod:`~fedtier.embedded_broker.codec` turns bytes into packet dataclasses
and back (pure functions); :mod:`~fedtier.embedded_broker.topics` matches filters;
:mod:`~fedtier.embedded_broker.session` and :mod:`~fedtier.embedded_broker.broker` hold the
delivery and routing rules without any I/O; :mod:`~fedtier.embedded_broker.server` is the
asyncio shell on a background thread; :mod:`~fedtier.embedded_broker.cli` the command line.
"""

from fedtier.embedded_broker.cli import main
from fedtier.embedded_broker.server import EmbeddedBroker

__all__ = ["EmbeddedBroker", "main"]
