"""A pure-Python MQTT broker for machines without Mosquitto (``fedtier demo`` falls back to it).

Standard library only. It speaks MQTT 3.1.1 and 5.0 with QoS 0, 1 and 2, retained messages,
wills, ``+``/``#`` wildcards, persistent in-memory sessions with offline queueing, the
client's Receive Maximum window, both directions of Maximum Packet Size, a Mosquitto-format
ACL and an optional Mosquitto-format password file (:mod:`~fedtier.embedded_broker.passwords`),
within safe resource limits (:mod:`~fedtier.embedded_broker.limits`). Deliberately absent:
TLS, shared subscriptions, topic aliases, Will Delay, persistence to disk.
The broker-behaviour tests hold it to Mosquitto's behaviour; docs/broker.md lists where the
two differ and why.

Layout, h11-style: :mod:`~fedtier.embedded_broker.codec` turns bytes into packet dataclasses
and back (pure functions); :mod:`~fedtier.embedded_broker.topics` matches filters,
:mod:`~fedtier.embedded_broker.acl` decides access, :mod:`~fedtier.embedded_broker.passwords`
checks credentials, :mod:`~fedtier.embedded_broker.limits` holds the limits and the byte budget;
:mod:`~fedtier.embedded_broker.session` and :mod:`~fedtier.embedded_broker.broker` hold the
delivery and routing rules without any I/O; :mod:`~fedtier.embedded_broker.server` is the
asyncio shell on a background thread; :mod:`~fedtier.embedded_broker.cli` the command line.
"""

from fedtier.embedded_broker.cli import main
from fedtier.embedded_broker.server import EmbeddedBroker

__all__ = ["EmbeddedBroker", "main"]
