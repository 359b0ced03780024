"""fedtier: hierarchical federated learning for fleets of small devices.

This package is the shared core every role imports: the wire envelope, topics, configs,
transports and the sans-I/O algorithms. It depends on numpy, msgpack and click only —
never on torch or onnxruntime — so a gateway or a device can install it alone.
"""

__version__ = "0.1.0"
