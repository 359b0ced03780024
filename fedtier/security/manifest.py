"""The rollout manifest: what a rollout trains, with which artifacts, over which cells.

The coordinator publishes it retained on ``ft/v1/{rollout}/manifest``; each edge relays it
to its cell (``.../cell/{cell}/down/manifest``). It is canonical JSON (sorted keys, no
whitespace) so that it can be hashed and signed byte-for-byte. Artifacts are listed by
sha256 and size (inside ``bundle``); devices fetch the files they lack from their edge
and verify every digest before anything reaches onnxruntime.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from fedtier.errors import LocalProtocolError, ManifestError
from fedtier.training.layout import canonical_json
from fedtier.transport.topics import check_id

MANIFEST_SCHEMA = 1


@dataclass(frozen=True, slots=True)
class Manifest:
    """One rollout's manifest. ``version`` increases with every manifest the coordinator issues.

    ``cells`` lists the cells taking part, not their devices: which devices train in a round
    travels with that round's task (``members``). So the manifest — retained, relayed to every
    cell and decoded by every device — stays the same small size however large the fleet.
    """

    rollout: str
    version: int
    algorithm: str
    bundle: Mapping[str, Any]
    cells: tuple[str, ...]
    rounds: int
    created: float
    expires: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    cell_bundles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per-cell artifact bundles where cells train different networks (HIST's submodels);
    a cell not listed trains ``bundle``."""

    def to_json(self) -> dict[str, Any]:
        out = {"schema": MANIFEST_SCHEMA, "rollout": self.rollout, "version": self.version,
               "algorithm": self.algorithm, "bundle": dict(self.bundle),
               "cells": sorted(self.cells), "rounds": self.rounds,
               "created": self.created, "expires": self.expires, "extra": dict(self.extra)}
        if self.cell_bundles:
            out["cell_bundles"] = {c: dict(b) for c, b in self.cell_bundles.items()}
        return out

    def bundle_for(self, cell: str) -> Mapping[str, Any]:
        """The bundle the devices of ``cell`` train."""
        return self.cell_bundles.get(cell, self.bundle)

    def digests_for(self, cell: str) -> dict[str, str]:
        """File name -> sha256 of the artifacts the devices of ``cell`` need."""
        return _digests(self.bundle_for(cell))

    def encode(self) -> bytes:
        return canonical_json(self.to_json())

    @property
    def artifact_digests(self) -> dict[str, str]:
        """File name -> sha256 of every artifact of the rollout (all bundles)."""
        out = _digests(self.bundle)
        for bundle in self.cell_bundles.values():
            out.update(_digests(bundle))
        return out

    @classmethod
    def decode(cls, data: bytes) -> "Manifest":
        """Parse and validate manifest bytes; ``ManifestError`` names what is wrong.

        Equal bytes give one shared ``Manifest`` (a value: frozen, and nothing changes its maps): in one
        process, the simulator's devices all read the same manifest, which lists every cell, so a copy per
        device grew with devices x cells (35 kB a device at 500 cells, 3.5 GB for 100,000 devices).
        """
        return _decode(bytes(data)) if cls is Manifest else cls._parse(data)

    @classmethod
    def _parse(cls, data: bytes) -> "Manifest":
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ManifestError(f"manifest is not JSON: {type(exc).__name__}: {exc}") from None
        if not isinstance(obj, dict):
            raise ManifestError("manifest is not a JSON object")
        if obj.get("schema") != MANIFEST_SCHEMA:
            raise ManifestError(f"manifest schema {obj.get('schema')!r}; this build reads {MANIFEST_SCHEMA}")

        def need(key: str, typ: type | tuple[type, ...]) -> Any:
            value = obj.get(key)
            if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
                raise ManifestError(f"manifest field {key!r} missing or of wrong type")
            return value

        rollout = need("rollout", str)
        raw_cells = need("cells", list)
        if not raw_cells or not all(isinstance(c, str) for c in raw_cells) or len(set(raw_cells)) != len(raw_cells):
            raise ManifestError("manifest field 'cells' must be a non-empty list of distinct cell ids")
        try:
            check_id(rollout, "rollout")
            cells = tuple(check_id(c, "cell") for c in raw_cells)
        except LocalProtocolError as exc:
            raise ManifestError(f"manifest ids invalid: {exc}") from None
        bundle = need("bundle", dict)
        _check_bundle(bundle, "bundle")
        cell_bundles = obj.get("cell_bundles", {})
        if not isinstance(cell_bundles, dict):
            raise ManifestError("manifest field 'cell_bundles' must map cells to bundles")
        for cell, cell_bundle in cell_bundles.items():
            if cell not in raw_cells or not isinstance(cell_bundle, dict):
                raise ManifestError(f"manifest cell_bundles names {cell!r}, which is not one of its cells")
            _check_bundle(cell_bundle, f"cell_bundles.{cell}")
        created = _finite(need("created", (int, float)), "created")
        expires = obj.get("expires")
        if expires is not None:
            if isinstance(expires, bool) or not isinstance(expires, (int, float)):
                raise ManifestError("manifest field 'expires' must be a number or null")
            expires = _finite(expires, "expires")
        extra = obj.get("extra", {})
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ManifestError("manifest field 'extra' must be an object")
        version, rounds = need("version", int), need("rounds", int)
        if version < 0 or rounds <= 0:
            raise ManifestError("manifest version/rounds out of range")
        return cls(rollout=rollout, version=version, algorithm=need("algorithm", str), bundle=bundle,
                   cells=cells, rounds=rounds, created=created, expires=expires, extra=extra,
                   cell_bundles=cell_bundles)


DECODED_KEPT = 8
"""Manifests whose parse ``Manifest.decode`` keeps (a node runs a few rollouts at a time)."""


@functools.lru_cache(maxsize=DECODED_KEPT)
def _decode(data: bytes) -> Manifest:
    return Manifest._parse(data)  # a ManifestError is raised again for the same bytes: lru_cache keeps no errors


def _digests(bundle: Mapping[str, Any]) -> dict[str, str]:
    return {f["filename"]: f["sha256"] for f in bundle.get("files", {}).values()}


def _check_bundle(bundle: Any, key: str) -> None:
    files = bundle.get("files") if isinstance(bundle, dict) else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("sha256"), str) and isinstance(f.get("filename"), str)
            and isinstance(f.get("size"), int) and not isinstance(f.get("size"), bool) for f in files.values()):
        raise ManifestError(f"manifest {key} lists no valid files")


def _finite(value: int | float, key: str) -> float:
    try:
        number = float(value)
    except OverflowError:
        raise ManifestError(f"manifest field {key!r} is out of range") from None
    if not math.isfinite(number):
        raise ManifestError(f"manifest field {key!r} is not finite")
    return number
