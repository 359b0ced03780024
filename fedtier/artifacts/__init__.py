"""Built training artifacts as every tier handles them, without torch or onnxruntime.

``bundle`` describes one built set of onnxruntime-training files (content-addressed by the
sha256 of its descriptor); ``cache`` is the directory of files named by their sha256 that edges
and devices keep, verified on the way in.

May import: ``fedtier.errors``, ``fedtier.training`` (layouts).
"""
