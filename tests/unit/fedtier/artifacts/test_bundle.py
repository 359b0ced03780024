"""ArtifactBundle: content addressing, verification and limits, on synthetic files (no ORT)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedtier.artifacts.bundle import (
    BUNDLE_JSON,
    MAX_IR_VERSION,
    MAX_OPSET,
    PORTABLE_FORMAT,
    PORTABLE_ROLES,
    ROLES,
    ArtifactBundle,
    BundleFile,
    PortableInfo,
    file_sha256,
)
from fedtier.errors import ArtifactError
from fedtier.training.layout import ArchSpec, Layout, ParamSpec, canonical_json

ARCH = ArchSpec("mlp", {"sizes": [4, 3]})
LAYOUT = Layout((ParamSpec("fc0.weight", (3, 4)), ParamSpec("fc0.bias", (3,))))
FILENAMES = {
    "training_model": "training_model.onnx",
    "eval_model": "eval_model.onnx",
    "optimizer_model": "optimizer_model.onnx",
    "checkpoint": "checkpoint",
}


def make_bundle(directory: Path, **overrides: object) -> ArtifactBundle:
    """Write four small fake artifact files and a bundle.json describing them."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, (role, name) in enumerate(FILENAMES.items()):
        (directory / name).write_bytes(f"{role}-{i}".encode() * (i + 3))
    fields: dict[str, object] = dict(
        directory=directory,
        files={role: BundleFile.of(directory / name) for role, name in FILENAMES.items()},
        arch=ARCH, layout=LAYOUT, opset=17, ir_version=10, seed=0,
    )
    fields.update(overrides)
    bundle = ArtifactBundle(**fields)  # type: ignore[arg-type]
    bundle.save()
    return bundle


def rewrite_descriptor(directory: Path, **changes: object) -> None:
    """Edit bundle.json and re-sign it with a matching bundle_id (bypassing the class)."""
    path = directory / BUNDLE_JSON
    obj = json.loads(path.read_text())
    obj.update(changes)
    obj.pop("bundle_id")
    obj["bundle_id"] = hashlib.sha256(canonical_json(obj)).hexdigest()
    path.write_text(json.dumps(obj))


def test_save_load_round_trip(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "b")
    loaded = ArtifactBundle.load(tmp_path / "b")
    assert loaded == bundle
    assert loaded.bundle_id == bundle.bundle_id
    assert loaded.path("checkpoint") == tmp_path / "b" / "checkpoint"
    assert set(loaded.files) == set(ROLES)
    assert loaded.files["eval_model"].sha256 == file_sha256(tmp_path / "b" / "eval_model.onnx")


def test_bundle_id_is_sha256_of_canonical_descriptor(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "b")
    descriptor = bundle.to_json()
    claimed = descriptor.pop("bundle_id")
    assert "directory" not in descriptor
    assert claimed == hashlib.sha256(canonical_json(descriptor)).hexdigest()
    # The directory is not part of the identity.
    elsewhere = make_bundle(tmp_path / "c")
    assert elsewhere.bundle_id == bundle.bundle_id


@pytest.mark.parametrize("change", ["arch", "layout", "opset", "ir_version", "seed", "file"])
def test_bundle_id_changes_with_content(tmp_path: Path, change: str) -> None:
    base = make_bundle(tmp_path / "base")
    overrides: dict[str, object] = {
        "arch": {"arch": ArchSpec("mlp", {"sizes": [4, 5]})},
        "layout": {"layout": Layout((ParamSpec("fc0.weight", (3, 4)),))},
        "opset": {"opset": 18},
        "ir_version": {"ir_version": 9},
        "seed": {"seed": 1},
        "file": {"files": {**base.files, "checkpoint": BundleFile("checkpoint", "0" * 64, 1)}},
    }[change]
    other = make_bundle(tmp_path / "other", **overrides)
    assert other.bundle_id != base.bundle_id


def test_json_round_trip_without_directory(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "b")
    wire = json.loads(json.dumps(bundle.to_json()))  # as it would travel in a manifest
    remote = ArtifactBundle.from_json(wire)
    assert remote.directory is None
    assert remote.bundle_id == bundle.bundle_id
    with pytest.raises(ArtifactError, match="no local directory"):
        remote.path("checkpoint")
    local = ArtifactBundle.from_json(wire, directory=tmp_path / "b")
    local.verify()
    with pytest.raises(KeyError):
        local.path("nope")


def test_from_json_rejects_wrong_bundle_id(tmp_path: Path) -> None:
    wire = make_bundle(tmp_path / "b").to_json()
    wire["seed"] = 5  # content changed, id not
    with pytest.raises(ArtifactError, match="bundle_id"):
        ArtifactBundle.from_json(wire)


@pytest.mark.parametrize("role", ROLES)
def test_corrupted_file_is_named(tmp_path: Path, role: str) -> None:
    make_bundle(tmp_path / "b")
    target = tmp_path / "b" / FILENAMES[role]
    data = bytearray(target.read_bytes())
    data[0] ^= 0xFF  # same size, different bytes
    target.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256") as info:
        ArtifactBundle.load(tmp_path / "b")
    assert FILENAMES[role] in str(info.value)
    assert role in str(info.value)
    ArtifactBundle.load(tmp_path / "b", verify=False)  # opt-out still parses


def test_truncated_and_missing_files_are_named(tmp_path: Path) -> None:
    make_bundle(tmp_path / "b")
    (tmp_path / "b" / "eval_model.onnx").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="eval_model.onnx.*bytes"):
        ArtifactBundle.load(tmp_path / "b")
    (tmp_path / "b" / "eval_model.onnx").unlink()
    with pytest.raises(ArtifactError, match="eval_model.onnx.*missing"):
        ArtifactBundle.load(tmp_path / "b")


def test_missing_or_invalid_descriptor(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="bundle.json"):
        ArtifactBundle.load(tmp_path)
    (tmp_path / BUNDLE_JSON).write_text("{not json")
    with pytest.raises(ArtifactError, match="bundle.json"):
        ArtifactBundle.load(tmp_path)
    make_bundle(tmp_path / "b")
    rewrite_descriptor(tmp_path / "b", format=99)
    with pytest.raises(ArtifactError, match="format"):
        ArtifactBundle.load(tmp_path / "b")


def test_opset_and_ir_limits(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="opset"):
        make_bundle(tmp_path / "a", opset=MAX_OPSET + 1)
    with pytest.raises(ArtifactError, match="IR"):
        make_bundle(tmp_path / "b", ir_version=MAX_IR_VERSION + 1)
    make_bundle(tmp_path / "c", opset=MAX_OPSET, ir_version=MAX_IR_VERSION)  # at the limit: ok
    # A descriptor that is self-consistent (valid id) but asks for a newer opset/IR.
    make_bundle(tmp_path / "d")
    rewrite_descriptor(tmp_path / "d", opset=22)
    with pytest.raises(ArtifactError, match="opset 22"):
        ArtifactBundle.load(tmp_path / "d", verify=False)
    make_bundle(tmp_path / "e")
    rewrite_descriptor(tmp_path / "e", ir_version=11)
    with pytest.raises(ArtifactError, match="IR version 11"):
        ArtifactBundle.load(tmp_path / "e", verify=False)


@pytest.mark.parametrize("bad", ["../checkpoint", "/etc/passwd", "..", "", BUNDLE_JSON, "a\\b"])
def test_unsafe_filenames_rejected(tmp_path: Path, bad: str) -> None:
    bundle = make_bundle(tmp_path / "b")
    files = {**bundle.files, "checkpoint": BundleFile(bad, "0" * 64, 1)}
    with pytest.raises(ArtifactError, match="unsafe"):
        ArtifactBundle(directory=tmp_path, files=files, arch=ARCH, layout=LAYOUT, opset=17,
                       ir_version=10)


def test_roles_must_be_complete(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "b")
    files = {k: v for k, v in bundle.files.items() if k != "optimizer_model"}
    with pytest.raises(ArtifactError, match="roles"):
        ArtifactBundle(directory=tmp_path, files=files, arch=ARCH, layout=LAYOUT, opset=17,
                       ir_version=10)


def test_descriptor_is_immutable(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "b")
    with pytest.raises(TypeError):
        bundle.files["checkpoint"] = bundle.files["eval_model"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        bundle.opset = 18  # type: ignore[misc]


def test_bundle_module_is_torch_and_ort_free() -> None:
    code = (
        "import sys, fedtier.artifacts.bundle\n"
        "heavy = [m for m in ('torch', 'onnxruntime', 'onnx') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- the portable training path (optional files, recorded in the descriptor) -------------------

PORTABLE_FILENAMES = {"portable_model": "portable_training_model.onnx",
                      "portable_checkpoint": "portable_checkpoint.f32"}


def make_portable_bundle(directory: Path, **overrides: object) -> ArtifactBundle:
    """A bundle with the two portable files and a record saying the lowering succeeded."""
    directory.mkdir(parents=True, exist_ok=True)
    for role, name in PORTABLE_FILENAMES.items():
        (directory / name).write_bytes(role.encode() * 5)
    base = make_bundle(directory)
    files = {**base.files, **{role: BundleFile.of(directory / name) for role, name in PORTABLE_FILENAMES.items()}}
    return make_bundle(directory, **{"files": files, "portable": PortableInfo(), **overrides})


def test_a_bundle_written_before_portable_graphs_loads_with_its_id(tmp_path: Path) -> None:
    """An older bundle.json (no ``portable`` key, four files) keeps loading, under the same id."""
    bundle = make_bundle(tmp_path / "b")
    descriptor = json.loads((tmp_path / "b" / BUNDLE_JSON).read_text())
    assert "portable" not in descriptor and set(descriptor["files"]) == set(ROLES)
    claimed = descriptor.pop("bundle_id")
    assert claimed == hashlib.sha256(canonical_json(descriptor)).hexdigest()  # the old formula
    loaded = ArtifactBundle.load(tmp_path / "b")
    assert loaded.bundle_id == claimed == bundle.bundle_id
    assert loaded.portable is None and not loaded.has_portable_graph


def test_portable_files_are_listed_hashed_and_verified(tmp_path: Path) -> None:
    bundle = make_portable_bundle(tmp_path / "b")
    assert bundle.has_portable_graph
    loaded = ArtifactBundle.load(tmp_path / "b")
    assert loaded == bundle and set(loaded.files) == set(ROLES) | set(PORTABLE_ROLES)
    assert loaded.to_json()["portable"] == {"format": PORTABLE_FORMAT, "unsupported_ops": []}
    assert loaded.path("portable_model") == tmp_path / "b" / "portable_training_model.onnx"
    target = tmp_path / "b" / "portable_checkpoint.f32"
    target.write_bytes(target.read_bytes()[:-1] + b"!")  # same size, other bytes
    with pytest.raises(ArtifactError, match="portable_checkpoint.*sha256"):
        ArtifactBundle.load(tmp_path / "b")


def test_the_portable_record_is_part_of_the_identity(tmp_path: Path) -> None:
    plain = make_bundle(tmp_path / "a")
    blocked = make_bundle(tmp_path / "b", portable=PortableInfo(unsupported_ops=("GeluGrad",)))
    assert blocked.bundle_id != plain.bundle_id
    assert not blocked.has_portable_graph
    assert ArtifactBundle.load(tmp_path / "b").portable == PortableInfo(unsupported_ops=("GeluGrad",))
    wire = blocked.to_json()
    wire["portable"] = {"format": PORTABLE_FORMAT, "unsupported_ops": ["ReluGrad"]}  # rewritten on the way
    with pytest.raises(ArtifactError, match="bundle_id"):
        ArtifactBundle.from_json(wire)


@pytest.mark.parametrize("case", ["files-without-record", "record-without-files", "blocked-with-files",
                                  "one-portable-file", "unknown-role", "future-format"])
def test_portable_files_and_record_must_agree(tmp_path: Path, case: str) -> None:
    full = make_portable_bundle(tmp_path / "b")
    four = {role: full.files[role] for role in ROLES}
    fields: dict[str, object] = {
        "files-without-record": {"files": dict(full.files), "portable": None},
        "record-without-files": {"files": four, "portable": PortableInfo()},
        "blocked-with-files": {"files": dict(full.files), "portable": PortableInfo(unsupported_ops=("X",))},
        "one-portable-file": {"files": {**four, "portable_model": full.files["portable_model"]},
                              "portable": PortableInfo()},
        "unknown-role": {"files": {**full.files, "extra": full.files["checkpoint"]}, "portable": PortableInfo()},
        "future-format": {"files": dict(full.files), "portable": PortableInfo(format=PORTABLE_FORMAT + 1)},
    }[case]
    with pytest.raises(ArtifactError):
        ArtifactBundle(directory=tmp_path / "b", arch=ARCH, layout=LAYOUT, opset=17, ir_version=10,
                       **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [[], "GeluGrad", {"unsupported_ops": "GeluGrad", "format": 1},
                                 {"unsupported_ops": [], "format": "1"}])
def test_malformed_portable_record_is_rejected(tmp_path: Path, bad: object) -> None:
    make_bundle(tmp_path / "b")
    rewrite_descriptor(tmp_path / "b", portable=bad)
    with pytest.raises(ArtifactError, match="portable"):
        ArtifactBundle.load(tmp_path / "b", verify=False)
