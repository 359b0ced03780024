"""fedtier.artifacts.cache: a content-addressed directory, verified on the way in and out."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fedtier.artifacts.cache import ArtifactCache, sha256_hex
from fedtier.errors import ArtifactError, ShaMismatchError

DATA = b"onnx model bytes \x00\xff" * 10
SHA = hashlib.sha256(DATA).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_sha256_hex() -> None:
    assert sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_put_get_has(tmp_path: Path) -> None:
    # Prepare
    cache = ArtifactCache(tmp_path / "cache")
    assert not cache.has(SHA)
    assert cache.get(SHA) is None

    # Execute
    path = cache.put(SHA, DATA)

    # Assert
    assert path == tmp_path / "cache" / SHA
    assert path.read_bytes() == DATA
    assert cache.has(SHA)
    assert cache.get(SHA) == DATA
    assert listing(tmp_path / "cache") == [SHA]  # no temporary files left behind


def test_put_is_idempotent(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)

    assert cache.put(SHA, DATA) == cache.put(SHA, DATA)
    assert listing(tmp_path) == [SHA]


def test_contents_survive_a_new_cache_object(tmp_path: Path) -> None:
    ArtifactCache(tmp_path).put(SHA, DATA)

    assert ArtifactCache(tmp_path).get(SHA) == DATA


def test_empty_file_is_storable(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    empty = hashlib.sha256(b"").hexdigest()

    cache.put(empty, b"")

    assert cache.get(empty) == b""


def test_put_with_the_wrong_digest_stores_nothing(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    other = hashlib.sha256(b"something else").hexdigest()

    with pytest.raises(ShaMismatchError):
        cache.put(other, DATA)

    assert listing(tmp_path) == []
    assert not cache.has(other)


def test_a_file_corrupted_on_disk_is_reported_missing_and_removed(tmp_path: Path) -> None:
    # Prepare
    cache = ArtifactCache(tmp_path)
    path = cache.put(SHA, DATA)
    path.write_bytes(DATA[:-1] + b"X")

    # Execute
    out = cache.get(SHA)

    # Assert
    assert out is None
    assert not path.exists()
    assert not cache.has(SHA)


def test_put_repairs_a_corrupted_file(tmp_path: Path) -> None:
    """``put`` skips the write when a file of that name exists, without checking it, so a
    corrupted copy stays and ``get`` keeps reporting the artifact missing after a ``put``."""
    cache = ArtifactCache(tmp_path)
    cache.put(SHA, DATA).write_bytes(b"garbage")

    cache.put(SHA, DATA)

    assert cache.get(SHA) == DATA


@pytest.mark.parametrize("digest", [SHA.upper(), SHA[:-1], SHA + "0", "", "../" + SHA[3:], "g" * 64,
                                    SHA[:32] + "/" + SHA[33:], " " * 64])
def test_invalid_digest_strings_are_refused(tmp_path: Path, digest: str) -> None:
    cache = ArtifactCache(tmp_path)

    for call in (cache.path, cache.has, cache.get):
        with pytest.raises(ArtifactError):
            call(digest)
    assert listing(tmp_path) == []


def test_put_with_an_invalid_digest_stores_nothing(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)

    with pytest.raises((ArtifactError, ShaMismatchError)):
        cache.put("../escape", DATA)

    assert listing(tmp_path) == []
    assert not (tmp_path.parent / "escape").exists()
