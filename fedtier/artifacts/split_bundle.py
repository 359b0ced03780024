"""Descriptor of HSGD's split-model artifacts (``SplitBundle``), torch- and onnxruntime-free.

Built by ``models.split_artifacts``: per split architecture a ``device`` and a ``host`` training set
(graph, eval graph, optimizer, checkpoint) whose partner values are graph inputs, and inference graphs
``embed1``/``embed2``. ``split_bundle.json`` lists every file's sha256 and size; the directory is named by
the sha256 of the descriptor's canonical JSON, so nodes verify what they load without the heavy stacks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from fedtier.errors import ArtifactError, LocalProtocolError
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
    descriptor: Mapping[str, Any] = field(default_factory=dict)
    """``split_bundle.json`` as read (the bytes its id hashes)."""

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
                   files=raw["files"], descriptor=raw)

    def manifest_entry(self) -> dict[str, Any]:
        """The bundle as a rollout manifest lists it: every file by ``graph/name``, sha256 and size (what
        nodes fetch and verify, like any bundle's), and the descriptor a node writes back to assemble it."""
        files = {key: {"filename": f"{key.split('/')[0]}/{entry['name']}", "sha256": entry["sha256"],
                       "size": entry["size"]} for key, entry in self.files.items()}
        return {"kind": KIND, "bundle_id": self.bundle_id, "descriptor": dict(self.descriptor), "files": files}


KIND = "split"
"""``kind`` of a manifest bundle that is a ``SplitBundle`` (HSGD); other bundles have none."""


def is_split(entry: Mapping[str, Any]) -> bool:
    return entry.get("kind") == KIND


def assemble(entry: Mapping[str, Any], cached: Callable[[str], Path], root: Path) -> SplitBundle:
    """Lay a manifest's split bundle out under ``root/<bundle_id>`` from cached files (by sha256), and load it
    (which verifies the descriptor's id and every file).

    Raises:
        ArtifactError: the entry is malformed, or what it lists does not verify.
    """
    descriptor, bundle_id = entry.get("descriptor"), str(entry.get("bundle_id", ""))
    if not isinstance(descriptor, dict) or not isinstance(descriptor.get("files"), dict) or not bundle_id.isalnum():
        raise ArtifactError("the manifest's split bundle has no valid descriptor")
    directory = Path(root) / bundle_id
    for key, item in descriptor["files"].items():
        graph = str(key).split("/")[0]
        name = str(item.get("name", "")) if isinstance(item, dict) else ""
        if graph not in (*GRAPHS, *EMBEDS) or not name or "/" in name or name.startswith("."):
            raise ArtifactError(f"the manifest's split bundle lists a bad file {key!r}")
        target = directory / graph / name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(cached(str(item["sha256"])), target)
            except OSError:
                shutil.copyfile(cached(str(item["sha256"])), target)
    (directory / DESCRIPTOR).write_text(json.dumps(descriptor, indent=1, sort_keys=True) + "\n")
    try:
        return SplitBundle.load(directory)
    except (KeyError, TypeError, ValueError, LocalProtocolError) as exc:
        raise ArtifactError(f"the manifest's split bundle does not load: {exc}") from None
