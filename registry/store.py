"""Content-addressed artifact store: files named by their sha256, verified on every read.

Layout: `<root>/sha256/<first two hex digits>/<full hex digest>`. The root is a local
folder by default, or any fsspec URL (`s3://bucket/prefix`, `memory://x`, ...). A write
goes to a temporary name next to its destination and is renamed into place, so a reader
never sees half a file; a read recomputes the hash and refuses a file that does not match.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import fsspec

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_BLOCK = 1 << 20


class ArtifactError(Exception):
    """An artifact is missing or its content does not match the hash it is stored under."""

    def __init__(self, message: str, path: str, expected_sha256: str) -> None:
        super().__init__(message)
        self.path = path
        self.expected_sha256 = expected_sha256


class ArtifactMissingError(ArtifactError):
    pass


class ArtifactCorruptedError(ArtifactError):
    def __init__(self, path: str, expected_sha256: str, actual_sha256: str) -> None:
        super().__init__(
            f"artifact {path} is corrupted: expected sha256 {expected_sha256}, file has {actual_sha256}",
            path,
            expected_sha256,
        )
        self.actual_sha256 = actual_sha256


@dataclass(frozen=True)
class StoredArtifact:
    """Where an artifact lives and what it must hash to; this is what the ledger records."""

    sha256: str
    size: int
    uri: str


def check_sha256(value: str, field: str = "sha256") -> str:
    if not isinstance(value, str) or not _SHA256.match(value):
        raise ValueError(f"{field}: expected 64 lowercase hex digits, got {value!r}")
    return value


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


class ArtifactStore:
    """Put files in by content, get them back verified."""

    def __init__(self, root: str | Path) -> None:
        root = str(root)
        self.fs, path = fsspec.core.url_to_fs(root)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local = "file" in protocols
        if self.is_local:
            path = str(Path(path).expanduser().resolve())
        self.root = path.rstrip("/")
        self.root_url = root if not self.is_local else self.root

    # -- naming --------------------------------------------------------------------
    def path_for(self, sha256: str) -> str:
        """The store's path (local path or path inside the fsspec filesystem) for a hash."""
        check_sha256(sha256)
        return f"{self.root}/sha256/{sha256[:2]}/{sha256}"

    def uri_for(self, sha256: str) -> str:
        path = self.path_for(sha256)
        return path if self.is_local else self.fs.unstrip_protocol(path)

    # -- writing -------------------------------------------------------------------
    def put_file(self, source: str | Path) -> StoredArtifact:
        """Store a local file; storing the same content twice writes it once."""
        source = Path(source)
        if not source.is_file():
            raise FileNotFoundError(f"artifact source {source}: not a file")
        sha256 = sha256_file(source)
        with open(source, "rb") as f:
            self._put_stream(sha256, f)
        return StoredArtifact(sha256, source.stat().st_size, self.uri_for(sha256))

    def put_bytes(self, data: bytes) -> StoredArtifact:
        sha256 = hashlib.sha256(data).hexdigest()
        with tempfile.TemporaryFile() as f:
            f.write(data)
            f.seek(0)
            self._put_stream(sha256, f)
        return StoredArtifact(sha256, len(data), self.uri_for(sha256))

    def _put_stream(self, sha256: str, stream: BinaryIO) -> None:
        if self._intact(sha256):
            return
        # A corrupted copy under this name is replaced: we hold the right content.
        final = self.path_for(sha256)
        parent = final.rsplit("/", 1)[0]
        tmp = f"{parent}/.{sha256}.{uuid.uuid4().hex}.tmp"
        if self.is_local:
            os.makedirs(parent, exist_ok=True)
            try:
                with open(tmp, "wb") as out:
                    shutil.copyfileobj(stream, out, _BLOCK)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, final)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            return
        self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as out:
                shutil.copyfileobj(stream, out, _BLOCK)
            self.fs.mv(tmp, final)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)
            raise

    # -- reading -------------------------------------------------------------------
    def exists(self, sha256: str) -> bool:
        return self.fs.exists(self.path_for(sha256))

    def _hash_of(self, path: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            for block in iter(lambda: f.read(_BLOCK), b""):
                digest.update(block)
        return digest.hexdigest()

    def _intact(self, sha256: str) -> bool:
        path = self.path_for(sha256)
        return self.fs.exists(path) and self._hash_of(path) == sha256

    def verify(self, sha256: str) -> str:
        """Check the stored file against its hash; return its store path or raise."""
        path = self.path_for(sha256)
        if not self.fs.exists(path):
            raise ArtifactMissingError(f"artifact {path} is missing (expected sha256 {sha256})", path, sha256)
        actual = self._hash_of(path)
        if actual != sha256:
            raise ArtifactCorruptedError(path, sha256, actual)
        return path

    def read_bytes(self, sha256: str) -> bytes:
        """The artifact's content, verified after reading (what is returned is what was hashed)."""
        path = self.path_for(sha256)
        try:
            with self.fs.open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise ArtifactMissingError(f"artifact {path} is missing (expected sha256 {sha256})", path, sha256) from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise ArtifactCorruptedError(path, sha256, actual)
        return data

    def fetch(self, sha256: str, destination: str | Path) -> Path:
        """Copy the artifact to a local file, verified, atomically (for MLflow, loaders...)."""
        destination = Path(destination)
        destination.parent.mkdir(parents=True, exist_ok=True)
        path = self.path_for(sha256)
        fd, tmp = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".tmp")
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                try:
                    src = self.fs.open(path, "rb")
                except FileNotFoundError:
                    raise ArtifactMissingError(
                        f"artifact {path} is missing (expected sha256 {sha256})", path, sha256
                    ) from None
                with src:
                    for block in iter(lambda: src.read(_BLOCK), b""):
                        digest.update(block)
                        out.write(block)
            if digest.hexdigest() != sha256:
                raise ArtifactCorruptedError(path, sha256, digest.hexdigest())
            os.replace(tmp, destination)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return destination

    def local_path(self, sha256: str) -> Path:
        """The verified file itself, for a local store (no copy); other stores must `fetch`."""
        if not self.is_local:
            raise ValueError(f"store {self.root_url} is not on local disk; use fetch()")
        return Path(self.verify(sha256))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write a text file so that readers see the old content or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
