"""A directory of files named by their sha256, written atomically and verified on the way in.

Edges keep the artifacts they relay here (so a second device asking costs the cloud
nothing); devices keep what they downloaded (so a restart does not download again).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from fedtier.errors import ArtifactError, ShaMismatchError


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _valid_digest(sha: str) -> bool:
    return len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)


class ArtifactCache:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, sha: str) -> Path:
        if not _valid_digest(sha):
            raise ArtifactError(f"not a sha256 digest: {sha!r}")
        return self.directory / sha

    def has(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def put(self, sha: str, data: bytes) -> Path:
        """Store ``data`` under ``sha``; ``ShaMismatchError`` if the bytes do not match."""
        if sha256_hex(data) != sha:
            raise ShaMismatchError(f"artifact bytes do not match digest {sha[:12]}…")
        final = self.path(sha)
        if final.is_file() and self.get(sha) is not None:  # get() deletes a corrupted copy
            return final
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return final

    def get(self, sha: str) -> bytes | None:
        """The stored bytes, re-verified (a corrupted file is deleted and reported missing)."""
        p = self.path(sha)
        if not p.is_file():
            return None
        data = p.read_bytes()
        if sha256_hex(data) != sha:
            p.unlink(missing_ok=True)
            return None
        return data
