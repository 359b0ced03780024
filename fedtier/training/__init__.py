"""What on-device training needs to know, without torch or onnxruntime.

``layout`` describes a model (architecture and named tensors, canonical JSON); ``trainer`` is the
contract a training backend fulfils for a device role; ``batching`` draws the same minibatches on
every backend; ``submodels`` cuts an MLP into HIST's per-cell submodels.

May import: ``fedtier.errors``, ``fedtier.rng``.
"""
