"""The content-addressed artifact store: atomic writes, verified reads, clear errors."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from registry import ArtifactCorruptedError, ArtifactMissingError, ArtifactStore, sha256_bytes


@pytest.fixture(params=["local", "memory"])
def any_store(request, tmp_path):
    if request.param == "local":
        return ArtifactStore(tmp_path / "store")
    return ArtifactStore(f"memory://registry-tests-{uuid.uuid4().hex}")


def test_put_and_read_back_by_hash(any_store, tmp_path):
    source = tmp_path / "adapter.safetensors"
    source.write_bytes(b"adapter weights" * 1000)
    stored = any_store.put_file(source)
    assert stored.sha256 == sha256_bytes(source.read_bytes())
    assert stored.size == source.stat().st_size
    assert stored.uri.endswith(f"/sha256/{stored.sha256[:2]}/{stored.sha256}")
    assert any_store.read_bytes(stored.sha256) == source.read_bytes()
    copy = any_store.fetch(stored.sha256, tmp_path / "out" / "copy.bin")
    assert copy.read_bytes() == source.read_bytes()
    # Same content again: same address, one file.
    assert any_store.put_bytes(source.read_bytes()) == stored


def test_altered_artifact_is_refused_with_path_and_expected_hash(any_store, tmp_path):
    stored = any_store.put_bytes(b"original atlas")
    path = any_store.path_for(stored.sha256)
    with any_store.fs.open(path, "wb") as f:
        f.write(b"tampered atlas")
    for read in (any_store.read_bytes, any_store.verify, lambda sha: any_store.fetch(sha, tmp_path / "x")):
        with pytest.raises(ArtifactCorruptedError) as err:
            read(stored.sha256)
        assert err.value.path == path and err.value.expected_sha256 == stored.sha256
        assert path in str(err.value) and stored.sha256 in str(err.value)
        assert err.value.actual_sha256 == sha256_bytes(b"tampered atlas")
    assert not (tmp_path / "x").exists()  # a refused fetch leaves nothing behind
    # Storing the right content again heals the corrupted copy.
    any_store.put_bytes(b"original atlas")
    assert any_store.read_bytes(stored.sha256) == b"original atlas"


def test_missing_artifact_is_reported(any_store, tmp_path):
    sha = sha256_bytes(b"never stored")
    for read in (any_store.read_bytes, any_store.verify, lambda s: any_store.fetch(s, tmp_path / "y")):
        with pytest.raises(ArtifactMissingError) as err:
            read(sha)
        assert err.value.expected_sha256 == sha and sha in str(err.value)
        assert err.value.path == any_store.path_for(sha)
    assert not any_store.exists(sha)


def test_bad_hash_and_missing_source_are_clear_errors(any_store, tmp_path):
    with pytest.raises(ValueError, match="64 lowercase hex"):
        any_store.read_bytes("abc")
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        any_store.put_file(tmp_path / "nope.bin")


def test_failed_write_leaves_no_file_and_no_temp(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path / "store")
    sha = sha256_bytes(b"payload")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        store.put_bytes(b"payload")
    monkeypatch.undo()
    assert not store.exists(sha)
    assert [p for p in Path(tmp_path / "store").rglob("*") if p.is_file()] == []


def test_local_path_is_verified(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    stored = store.put_bytes(b"weights")
    assert store.local_path(stored.sha256).read_bytes() == b"weights"
    Path(store.path_for(stored.sha256)).write_bytes(b"weightz")
    with pytest.raises(ArtifactCorruptedError):
        store.local_path(stored.sha256)
    with pytest.raises(ValueError, match="not on local disk"):
        ArtifactStore("memory://elsewhere").local_path(stored.sha256)
