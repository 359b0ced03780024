"""Descriptor of one built set of onnxruntime-training artifacts (``ArtifactBundle``).

A bundle is a directory holding the four files a device needs to train one architecture
with onnxruntime-training (training, eval and optimizer graphs plus the initial checkpoint)
and a ``bundle.json`` that lists them with their sha256 and size. Bundles built since the
portable graphs exist also hold the two files a device with only the stock ``onnxruntime``
trains from (:data:`PORTABLE_ROLES`): the training graph with every contrib op lowered to
standard ONNX ops (``models.portable``), and the initial parameters as raw little-endian
float32 in layout order, followed by a user model's frozen tensors if it has any
(onnxruntime-training's checkpoint format needs its runtime to read). The ``portable``
record says whether the lowering succeeded and, if not, which ops had no lowering; a bundle
without it (built before) loads as before, with the same id.

The descriptor is content-addressed: its ``bundle_id`` is the sha256 of its canonical JSON
(everything except the local directory), so the same id names the same bytes on the
coordinator, in a rollout manifest and on a device, and a device can refuse a bundle whose
files were altered or truncated.

This module is deliberately torch-free and onnxruntime-free (it only reads JSON and hashes
files), so gateways and devices can check bundles without the heavy stacks. It does not
parse ONNX either: the opset and IR version are recorded by the builder
(``models.artifacts``) and only re-checked here against what ORT 1.19.2 can load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from fedtier.errors import ArtifactError
from fedtier.training.layout import ArchSpec, Layout, canonical_json

logger = logging.getLogger(__name__)

BUNDLE_FORMAT = 1
"""Version of the ``bundle.json`` schema. Bump on any incompatible change."""

BUNDLE_JSON = "bundle.json"
"""Name of the descriptor file inside a bundle directory."""

ROLES: tuple[str, ...] = ("training_model", "eval_model", "optimizer_model", "checkpoint")
"""The files every bundle has, by role."""

PORTABLE_ROLES: tuple[str, ...] = ("portable_model", "portable_checkpoint")
"""The files of the portable training path: a bundle has both (lowering succeeded) or neither."""

PORTABLE_FORMAT = 1
"""Version of the portable graph's interface (inputs, outputs, checkpoint layout). Bump on change.

Format 1 graphs of users' models may take a float ``target`` instead of ``labels`` and frozen
tensors after the parameters (their values after the parameters in the checkpoint); the
built-in models' graphs have neither, so their bundles did not change when this was added,
and a reader that expects neither refuses such a graph at its input check."""

MAX_OPSET = 21
"""Highest ai.onnx opset onnxruntime-training 1.19.2 accepts (22+ fail in generate_artifacts)."""

MAX_IR_VERSION = 10
"""Highest ONNX IR version ORT 1.19.2 loads (onnx>=1.17 writes IR 11+, which it refuses)."""

_HASH_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks (artifacts can be many MB).

    Args:
        path: File to hash.

    Returns:
        The lowercase hex digest.

    Raises:
        OSError: If the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_filename(role: str, filename: str) -> None:
    """Refuse names that would escape the bundle directory (descriptors can come off the wire)."""
    if (
        not filename
        or filename in (".", "..", BUNDLE_JSON)
        or "/" in filename
        or "\\" in filename
        or "\x00" in filename
    ):
        raise ArtifactError(f"bundle file for role {role!r} has an unsafe name: {filename!r}")


@dataclass(frozen=True, slots=True)
class BundleFile:
    """One file of a bundle: its name inside the bundle directory, sha256 and size in bytes."""

    filename: str
    sha256: str
    size: int

    @classmethod
    def of(cls, path: Path) -> "BundleFile":
        """Describe an existing file (hash and size it).

        Args:
            path: The file; only its base name is recorded.

        Returns:
            The description.

        Raises:
            OSError: If the file cannot be read.
        """
        path = Path(path)
        return cls(filename=path.name, sha256=file_sha256(path), size=path.stat().st_size)

    def to_json(self) -> dict[str, Any]:
        return {"filename": self.filename, "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "BundleFile":
        try:
            return cls(filename=str(obj["filename"]), sha256=str(obj["sha256"]).lower(),
                       size=int(obj["size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"malformed bundle file entry {obj!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class PortableInfo:
    """What the bundle's builder recorded about the portable training graph.

    ``unsupported_ops`` is empty when the graph was lowered (the bundle then has both
    :data:`PORTABLE_ROLES` files); otherwise it names the ops of the generated training graph
    that have no lowering, and devices without onnxruntime-training refuse the bundle
    with that list in the message.
    """

    format: int = PORTABLE_FORMAT
    unsupported_ops: tuple[str, ...] = ()

    @property
    def lowered(self) -> bool:
        return not self.unsupported_ops

    def to_json(self) -> dict[str, Any]:
        return {"format": int(self.format), "unsupported_ops": list(self.unsupported_ops)}

    @classmethod
    def from_json(cls, obj: Any) -> "PortableInfo":
        if not isinstance(obj, Mapping):
            raise ArtifactError(f"bundle 'portable' must be a JSON object, got {obj!r}")
        ops = obj.get("unsupported_ops", [])
        fmt = obj.get("format")
        if isinstance(fmt, bool) or not isinstance(fmt, int):
            raise ArtifactError(f"bundle 'portable.format' must be an int, got {fmt!r}")
        if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):
            raise ArtifactError(f"bundle 'portable.unsupported_ops' must be a list of strings, got {ops!r}")
        return cls(format=fmt, unsupported_ops=tuple(ops))


@dataclass(frozen=True, slots=True)
class ArtifactBundle:
    """One built artifact set: where it is, what files it has, and which model they train.

    ``bundle_id`` is computed, never passed: the sha256 of :meth:`descriptor`'s canonical
    JSON. ``directory`` is ``None`` for a descriptor taken from a manifest that has not been
    matched to a local copy yet; :meth:`path` then raises.

    ``seed`` is the seed of the initial weights stored in the checkpoint. They only matter
    for the first round (rounds ship parameters), but a torch-backed device rebuilds them
    from ``(arch, seed)``, so the seed is part of the identity.

    ``portable`` is ``None`` for bundles built before portable graphs existed; the
    descriptor then has no ``portable`` key, so such bundles keep their ``bundle_id``.
    """

    directory: Path | None
    files: Mapping[str, BundleFile]
    arch: ArchSpec
    layout: Layout
    opset: int
    ir_version: int
    seed: int = 0
    portable: PortableInfo | None = None
    bundle_id: str = field(init=False)

    def __post_init__(self) -> None:
        extra = set(self.files) - set(ROLES)
        if not set(ROLES) <= set(self.files) or extra - set(PORTABLE_ROLES):
            raise ArtifactError(
                f"bundle roles {sorted(self.files)} differ from the required {sorted(ROLES)} "
                f"(plus optionally {sorted(PORTABLE_ROLES)})")
        has_portable_files = bool(extra)
        if has_portable_files and extra != set(PORTABLE_ROLES):
            raise ArtifactError(f"bundle has {sorted(extra)} but not all of {sorted(PORTABLE_ROLES)}")
        lowered = self.portable is not None and self.portable.lowered
        if has_portable_files != lowered:
            raise ArtifactError(
                f"bundle portable record {self.portable!r} disagrees with its files {sorted(self.files)}: "
                "a lowered graph comes with both portable files, an unlowered one with neither")
        if self.portable is not None and self.portable.format != PORTABLE_FORMAT:
            raise ArtifactError(f"unsupported portable graph format {self.portable.format}; this build "
                                f"reads {PORTABLE_FORMAT}")
        for role, entry in self.files.items():
            _check_filename(role, entry.filename)
        names = [entry.filename for entry in self.files.values()]
        if len(set(names)) != len(names):
            raise ArtifactError(f"bundle roles share a file name: {names}")
        if not 1 <= int(self.opset) <= MAX_OPSET:
            raise ArtifactError(
                f"bundle opset {self.opset} is not supported (onnxruntime-training 1.19.2 "
                f"accepts 1..{MAX_OPSET})")
        if not 1 <= int(self.ir_version) <= MAX_IR_VERSION:
            raise ArtifactError(
                f"bundle ONNX IR version {self.ir_version} is not supported (onnxruntime-"
                f"training 1.19.2 loads up to IR {MAX_IR_VERSION}; build with onnx<1.17)")
        if self.directory is not None:
            object.__setattr__(self, "directory", Path(self.directory))
        # Freeze the role map so the descriptor cannot drift away from its id.
        object.__setattr__(self, "files", MappingProxyType(
            {role: self.files[role] for role in (*ROLES, *PORTABLE_ROLES) if role in self.files}))
        object.__setattr__(self, "bundle_id",
                           hashlib.sha256(canonical_json(self.descriptor())).hexdigest())

    def __hash__(self) -> int:
        # The generated hash would hash the mutable-typed fields (dict options, mapping proxy).
        return hash((self.bundle_id, self.directory))

    # --- serialisation -----------------------------------------------------------------

    def descriptor(self) -> dict[str, Any]:
        """Everything that identifies the bundle (no local directory, no id): what is hashed."""
        descriptor: dict[str, Any] = {
            "format": BUNDLE_FORMAT,
            "files": {role: entry.to_json() for role, entry in self.files.items()},
            "arch": self.arch.to_json(),
            "layout": self.layout.to_json(),
            "opset": int(self.opset),
            "ir_version": int(self.ir_version),
            "seed": int(self.seed),
        }
        if self.portable is not None:  # absent for older bundles: their ids must not change
            descriptor["portable"] = self.portable.to_json()
        return descriptor

    @property
    def has_portable_graph(self) -> bool:
        """True when the bundle holds the portable training graph and its checkpoint."""
        return self.portable is not None and self.portable.lowered

    def to_json(self) -> dict[str, Any]:
        """The descriptor plus its ``bundle_id``: what goes into ``bundle.json`` or a manifest."""
        return {**self.descriptor(), "bundle_id": self.bundle_id}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], directory: Path | str | None = None
                  ) -> "ArtifactBundle":
        """Rebuild a bundle descriptor, checking its claimed id.

        Args:
            obj: Output of :meth:`to_json` (e.g. from a manifest or ``bundle.json``).
            directory: Local directory holding the files, if known.

        Returns:
            The descriptor (files are *not* verified; see :meth:`verify`).

        Raises:
            ArtifactError: Unknown format, malformed fields, unsupported opset/IR, or a
                ``bundle_id`` that does not match the content.
        """
        if not isinstance(obj, Mapping):
            raise ArtifactError(f"bundle descriptor must be a JSON object, got {type(obj).__name__}")
        if obj.get("format") != BUNDLE_FORMAT:
            raise ArtifactError(
                f"unsupported bundle format {obj.get('format')!r}; this build reads {BUNDLE_FORMAT}")
        try:
            files = {str(role): BundleFile.from_json(entry) for role, entry in obj["files"].items()}
            bundle = cls(
                directory=Path(directory) if directory is not None else None,
                files=files,
                arch=ArchSpec.from_json(obj["arch"]),
                layout=Layout.from_json(obj["layout"]),
                opset=int(obj["opset"]),
                ir_version=int(obj["ir_version"]),
                seed=int(obj["seed"]),
                portable=PortableInfo.from_json(obj["portable"]) if "portable" in obj else None,
            )
        except ArtifactError:
            raise
        except Exception as exc:  # KeyError, TypeError, ValueError, LocalProtocolError...
            raise ArtifactError(f"malformed bundle descriptor: {exc!r}") from exc
        claimed = obj.get("bundle_id")
        if claimed != bundle.bundle_id:
            raise ArtifactError(
                f"bundle_id {claimed!r} does not match the descriptor's content "
                f"({bundle.bundle_id})")
        return bundle

    # --- files on disk -----------------------------------------------------------------

    @classmethod
    def load(cls, directory: Path | str, verify: bool = True) -> "ArtifactBundle":
        """Read ``<directory>/bundle.json`` and (by default) check every file against it.

        Args:
            directory: The bundle directory.
            verify: Hash every file and compare sha256 and size (a few ms for small models).

        Returns:
            The bundle, with ``directory`` set.

        Raises:
            ArtifactError: ``bundle.json`` missing or invalid, opset/IR unsupported, or (with
                ``verify``) a file missing or differing from its recorded size or sha256.
        """
        directory = Path(directory)
        descriptor_path = directory / BUNDLE_JSON
        try:
            obj = json.loads(descriptor_path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ArtifactError(f"{descriptor_path} is missing") from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{descriptor_path} cannot be read: {exc}") from exc
        bundle = cls.from_json(obj, directory=directory)
        if verify:
            bundle.verify()
        return bundle

    def verify(self) -> None:
        """Check that every file exists with the recorded size and sha256.

        Raises:
            ArtifactError: Naming the first file that is missing or differs, or if the
                bundle has no local directory.
        """
        for role, entry in self.files.items():
            path = self.path(role)
            try:
                size = path.stat().st_size
            except FileNotFoundError as exc:
                raise ArtifactError(f"bundle {self.bundle_id[:12]}: {role} file {path} is missing"
                                    ) from exc
            if size != entry.size:
                raise ArtifactError(
                    f"bundle {self.bundle_id[:12]}: {role} file {path} has {size} bytes, "
                    f"expected {entry.size}")
            digest = file_sha256(path)
            if digest != entry.sha256:
                raise ArtifactError(
                    f"bundle {self.bundle_id[:12]}: {role} file {path} has sha256 {digest}, "
                    f"expected {entry.sha256}")

    def path(self, role: str) -> Path:
        """Absolute-or-relative path of a role's file in the local directory.

        Args:
            role: One of :data:`ROLES`, or of :data:`PORTABLE_ROLES` if the bundle has them.

        Returns:
            ``directory / filename``.

        Raises:
            KeyError: Unknown role.
            ArtifactError: The bundle has no local directory.
        """
        if role not in self.files:
            raise KeyError(f"unknown bundle role {role!r}; this bundle has {tuple(self.files)}")
        if self.directory is None:
            raise ArtifactError(f"bundle {self.bundle_id[:12]} has no local directory")
        return self.directory / self.files[role].filename

    def save(self) -> Path:
        """Write ``bundle.json`` into the directory atomically (temp file + rename).

        Returns:
            Path of the written ``bundle.json``.

        Raises:
            ArtifactError: The bundle has no local directory.
            OSError: The file cannot be written.
        """
        if self.directory is None:
            raise ArtifactError(f"bundle {self.bundle_id[:12]} has no local directory")
        target = self.directory / BUNDLE_JSON
        write_text_atomic(target, json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
        return target


def write_text_atomic(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` via a fsynced temp file and ``os.replace``.

    Readers see either the old or the new content, never a partial file.

    Args:
        target: Destination file; its directory must exist.
        text: UTF-8 text to write.

    Raises:
        OSError: The file cannot be written.
    """
    target = Path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; descriptors are not secret
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
