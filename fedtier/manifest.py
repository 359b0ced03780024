"""The rollout manifest: what a rollout trains, with which artifacts, over which cells.

The coordinator publishes it retained on ``ft/v1/{rollout}/manifest``; each edge relays it
to its cell (``.../cell/{cell}/down/manifest``). It is canonical JSON (sorted keys, no
whitespace) so that it can be hashed and signed byte-for-byte. Artifacts are listed by
sha256 and size (inside ``bundle``); devices fetch the files they lack from their edge
and verify every digest before anything reaches onnxruntime.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from fedtier.errors import LocalProtocolError, ManifestError
from fedtier.layout import canonical_json
from fedtier.topics import check_id

MANIFEST_SCHEMA = 1


@dataclass(frozen=True, slots=True)
class Manifest:
    """One rollout's manifest. ``version`` increases with every manifest the coordinator issues."""

    rollout: str
    version: int
    algorithm: str
    bundle: Mapping[str, Any]
    cells: Mapping[str, tuple[str, ...]]
    rounds: int
    created: float
    expires: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"schema": MANIFEST_SCHEMA, "rollout": self.rollout, "version": self.version,
                "algorithm": self.algorithm, "bundle": dict(self.bundle),
                "cells": {c: list(m) for c, m in self.cells.items()}, "rounds": self.rounds,
                "created": self.created, "expires": self.expires, "extra": dict(self.extra)}

    def encode(self) -> bytes:
        return canonical_json(self.to_json())

    @property
    def artifact_digests(self) -> dict[str, str]:
        """File name -> sha256 of every artifact the rollout needs."""
        return {f["filename"]: f["sha256"] for f in self.bundle.get("files", {}).values()}

    def cell_of(self, device: str) -> str | None:
        for cell, members in self.cells.items():
            if device in members:
                return cell
        return None

    @classmethod
    def decode(cls, data: bytes) -> "Manifest":
        """Parse and validate manifest bytes; ``ManifestError`` names what is wrong."""
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
        raw_cells = need("cells", dict)
        if not all(isinstance(m, list) and all(isinstance(d, str) for d in m) for m in raw_cells.values()):
            raise ManifestError("manifest field 'cells' must map cell ids to lists of device ids")
        try:
            check_id(rollout, "rollout")
            cells = {check_id(c, "cell"): tuple(check_id(d, "device") for d in m) for c, m in raw_cells.items()}
        except LocalProtocolError as exc:
            raise ManifestError(f"manifest ids invalid: {exc}") from None
        bundle = need("bundle", dict)
        files = bundle.get("files")
        if not isinstance(files, dict) or not all(
                isinstance(f, dict) and isinstance(f.get("sha256"), str) and isinstance(f.get("filename"), str)
                and isinstance(f.get("size"), int) for f in files.values()):
            raise ManifestError("manifest bundle lists no valid files")
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
                   cells=cells, rounds=rounds, created=created, expires=expires, extra=extra)


def _finite(value: int | float, key: str) -> float:
    try:
        number = float(value)
    except OverflowError:
        raise ManifestError(f"manifest field {key!r} is out of range") from None
    if not math.isfinite(number):
        raise ManifestError(f"manifest field {key!r} is not finite")
    return number
