"""Descriptor of HSGD's split-model artifacts (``SplitBundle``), torch- and onnxruntime-free.

Built by ``models.split_artifacts``: per split architecture a ``device`` and a ``host`` training set
(graph, eval graph, optimizer, checkpoint) whose partner values are graph inputs, and inference graphs
``embed1``/``embed2``. ``split_bundle.json`` lists every file's sha256 and size; the directory is named by
the sha256 of the descriptor's canonical JSON, so nodes verify what they load without the heavy stacks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fedtier.errors import ArtifactError
from fedtier.training.layout import canonical_json
from fedtier.training.split import SplitArch

FORMAT = 1
DESCRIPTOR = "split_bundle.json"
GRAPHS = ("device", "host")
EMBEDS = ("embed1", "embed2")
INPUTS = {"device": ("x2", "zeta1", "theta0_w", "theta0_b"), "host": ("x1", "z2")}
PARAMS = {"device": {"theta2/w": "w2", "theta2/b": "b2"},
          "host": {"theta0/w": "w0", "theta0/b": "b0", "theta1/w": "w1", "theta1/b": "b1"}}
"""Per training graph: layout name -> ONNX initializer name (the trainable tensors, in graph order)."""


@dataclass(frozen=True)
class SplitBundle:
    """A built, verified set of split-model artifacts in ``directory`` (named ``bundle_id``)."""

    directory: Path
    bundle_id: str
    arch: SplitArch
    seed: int
    files: Mapping[str, Mapping[str, Any]]

    def path(self, graph: str, role: str) -> Path:
        return self.directory / graph / self.files[f"{graph}/{role}"]["name"]

    def artifact_files(self) -> dict[str, str]:
        """Relative file path -> sha256 of every file (what a manifest lists)."""
        return {key: str(entry["sha256"]) for key, entry in self.files.items()}

    @classmethod
    def load(cls, directory: Path) -> "SplitBundle":
        """Read and verify a stored set: the descriptor's id and every file's sha256 and size."""
        raw = json.loads((directory / DESCRIPTOR).read_text())
        bundle_id = hashlib.sha256(canonical_json(raw)).hexdigest()
        if bundle_id != directory.name:
            raise ArtifactError(f"split bundle {directory.name[:12]} has descriptor id {bundle_id[:12]}")
        for key, entry in raw["files"].items():
            path = directory / key.split("/")[0] / entry["name"]
            data = path.read_bytes() if path.is_file() else b""
            if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise ArtifactError(f"split bundle file {key} is missing or altered")
        return cls(directory=directory, bundle_id=bundle_id, arch=SplitArch(**raw["arch"]), seed=int(raw["seed"]),
                   files=raw["files"])
