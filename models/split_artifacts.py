"""onnxruntime-training artifacts of HSGD's split model, with the partner values as graph inputs.

Three graphs per split architecture (``fedtier.training.split.SplitArch``), digest §7:

* ``device`` — training graph ``(x2, zeta1, theta0_w, theta0_b, labels) -> (loss, logits)``; trainable:
  ``theta2`` only. The host's embedding ``zeta1`` and the frozen head ``theta0`` are *inputs*, so the
  values the edge relays every interval are fed as they are, never written into a checkpoint.
* ``host`` — training graph ``(x1, z2, labels) -> (loss, logits)``; trainable: ``theta0``, ``theta1``;
  the devices' embeddings ``z2`` are an input (no gradient flows back to a device).
* ``embed2`` / ``embed1`` — inference graphs ``(x, w, b) -> relu(x w^T + b)`` that compute the exchanged
  ``zeta2`` (``Z1``) at the parameters a node holds (inputs, so no checkpoint is needed).

The set is content-addressed like every bundle: ``split_bundle.json`` lists each file's sha256 and
size, and the directory is named by the sha256 of that descriptor's canonical JSON
(``fedtier.training.layout.canonical_json``), so the same id names the same bytes everywhere. A second
build of the same (arch, seed) returns the stored set. ``artifact_files`` gives file name -> sha256 for
a manifest.

torch, onnx and onnxruntime are imported inside functions.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedtier.artifacts.split_bundle import DESCRIPTOR, EMBEDS, FORMAT, GRAPHS, INPUTS, PARAMS, SplitBundle
from fedtier.errors import ArtifactError
from fedtier.training.layout import canonical_json
from fedtier.training.split import SplitArch, init_params
from models.artifacts import FILENAMES, _generate, _reset_graph_name_counter



def _modules(arch: SplitArch, seed: int) -> dict[str, Any]:
    import torch
    from torch import nn

    params = {k: torch.tensor(v) for k, v in init_params(arch, seed).items()}

    class Device(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w2 = nn.Parameter(params["theta2/w"].clone())
            self.b2 = nn.Parameter(params["theta2/b"].clone())

        def forward(self, x2: Any, zeta1: Any, theta0_w: Any, theta0_b: Any) -> Any:
            h2 = torch.relu(x2 @ self.w2.t() + self.b2)
            return torch.cat([zeta1, h2], 1) @ theta0_w.t() + theta0_b

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w0 = nn.Parameter(params["theta0/w"].clone())
            self.b0 = nn.Parameter(params["theta0/b"].clone())
            self.w1 = nn.Parameter(params["theta1/w"].clone())
            self.b1 = nn.Parameter(params["theta1/b"].clone())

        def forward(self, x1: Any, z2: Any) -> Any:
            h1 = torch.relu(x1 @ self.w1.t() + self.b1)
            return torch.cat([h1, z2], 1) @ self.w0.t() + self.b0

    class Embed(nn.Module):
        def forward(self, x: Any, w: Any, b: Any) -> Any:
            return torch.relu(x @ w.t() + b)

    z = torch.zeros
    return {"device": (Device(), (z(2, arch.x2), z(2, arch.d1), z(arch.classes, arch.d1 + arch.d2), z(arch.classes))),
            "host": (Host(), (z(2, arch.x1), z(2, arch.d2))),
            "embed1": (Embed(), (z(2, arch.x1), z(arch.d1, arch.x1), z(arch.d1))),
            "embed2": (Embed(), (z(2, arch.x2), z(arch.d2, arch.x2), z(arch.d2)))}


def _export(module: Any, example: tuple[Any, ...], names: tuple[str, ...], path: Path, batch_inputs: int) -> Any:
    import warnings

    import onnx
    import torch

    module.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        torch.onnx.export(module, example, str(path), dynamo=False, export_params=True, opset_version=17,
                          do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
                          keep_initializers_as_inputs=False, input_names=list(names), output_names=["logits"],
                          dynamic_axes={**{n: {0: "batch"} for n in names[:batch_inputs]}, "logits": {0: "batch"}})
    return onnx.load(str(path))


def build_split_artifacts(arch: SplitArch, store_dir: Path | str, *, seed: int = 0) -> SplitBundle:
    """The split-model artifacts of ``(arch, seed)`` in ``store_dir``, built only if missing."""
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    index = store / "by-split-arch" / hashlib.sha256(canonical_json({**asdict(arch), "seed": seed})).hexdigest()
    if index.is_file():
        existing = store / index.read_text().strip()
        if existing.is_dir():
            return SplitBundle.load(existing)
    tmp = Path(tempfile.mkdtemp(prefix=".build-split-", dir=store))
    try:
        files: dict[str, dict[str, Any]] = {}
        modules = _modules(arch, seed)
        for graph in GRAPHS:
            module, example = modules[graph]
            out = tmp / graph
            out.mkdir()
            forward = _export(module, example, INPUTS[graph], tmp / f"{graph}_forward.onnx", batch_inputs=2)
            init_names = [i.name for i in forward.graph.initializer]
            if init_names != list(PARAMS[graph].values()):
                raise ArtifactError(f"{graph} graph initializers {init_names} != {list(PARAMS[graph].values())}")
            _reset_graph_name_counter()
            _generate(forward, out, trainable=init_names, loss="cross_entropy")
            for role, name in FILENAMES.items():
                files[f"{graph}/{role}"] = _entry(out / name)
        for graph in EMBEDS:
            module, example = modules[graph]
            out = tmp / graph
            out.mkdir()
            _export(module, example, ("x", "w", "b"), out / "embed.onnx", batch_inputs=1)
            files[f"{graph}/model"] = _entry(out / "embed.onnx")
        for leftover in tmp.glob("*_forward.onnx"):
            leftover.unlink()
        descriptor = {"format": FORMAT, "arch": asdict(arch), "seed": seed, "files": files,
                      "inputs": {g: list(v) for g, v in INPUTS.items()}, "params": PARAMS}
        (tmp / DESCRIPTOR).write_text(json.dumps(descriptor, indent=1, sort_keys=True) + "\n")
        bundle_id = hashlib.sha256(canonical_json(json.loads((tmp / DESCRIPTOR).read_text()))).hexdigest()
        final = store / bundle_id
        if not final.exists():
            tmp.rename(final)
        index.parent.mkdir(exist_ok=True)
        index.write_text(bundle_id + "\n")
        return SplitBundle.load(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _entry(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"name": path.name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
