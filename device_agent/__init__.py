"""The process on a device: hosts a device role with a local trainer, data and an outbox.

Imports only ``fedtier`` (plus paho-mqtt and onnxruntime); never torch. The optional torch
trainer backend imports torch lazily, only when ``trainer = "torch"`` is configured.
"""
