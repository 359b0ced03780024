"""Transports move bytes between nodes: MQTT (``mqtt``) in deployment, in-memory for simulation.

Both split messages over the size limit into chunks and reassemble them, count traffic per
channel, and hand every inbound message to the node as an ``Inbound`` that the node
confirms after processing (so an acknowledgement never precedes durable handling).
"""

from fedtier.transport.base import Inbound, Traffic, Transport

__all__ = ["Inbound", "Traffic", "Transport"]
