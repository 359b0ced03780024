"""Torch model zoo -> ONNX -> onnxruntime-training artifacts (built once per architecture).

Only this package and ``cloud_coordinator`` import torch, and only inside functions, so
``import models`` itself stays cheap.
"""
