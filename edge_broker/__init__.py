"""The process on a gateway: hosts the edge role of one cell between the cell broker and the cloud.

Imports only ``fedtier`` (plus paho-mqtt); never torch, never onnxruntime.
"""
