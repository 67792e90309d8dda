"""Verified tensor files: safetensors + a JSON manifest that records the file's sha256.

Every artifact the method writes (atlases, adapters, checkpoints) goes through here, so
every one is written atomically (temp file, fsync, rename) and verified when read back.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


class IntegrityError(ValueError):
    """A stored file is missing, corrupted or does not match what its manifest says."""


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_bytes(obj: Any) -> bytes:
    """The bytes every JSON manifest is written as (keys sorted: the same object, the same sha256)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def config_hash(*parts) -> str:
    """sha256 of the canonical JSON of `parts` (dicts, lists, strings): a content key."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, json_bytes(obj))


@contextmanager
def atomic_folder(out: str | Path) -> Iterator[Path]:
    """A new folder at `out` (which must not exist, or be empty) that appears only whole: the block
    writes into a hidden sibling, renamed to `out` when the block ends without an error."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out: {out} exists and is not an empty folder; choose a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def manifest_path(tensor_path: str | Path) -> Path:
    return Path(tensor_path).with_suffix(".json")


def save_verified(path: str | Path, tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> dict:
    """Save `tensors` to `path` (.safetensors) and `manifest` + sha256 to `path` with .json.

    The tensors file is renamed into place first and the manifest second, so a manifest
    always describes a complete tensors file; a crash in between leaves the old manifest,
    whose sha256 no longer matches, and loading refuses it instead of mixing versions.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp)
        digest = sha256_file(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    manifest = {**manifest, "file": path.name, "sha256": digest}
    atomic_write_json(manifest_path(path), manifest)
    return manifest


def load_verified(path: str | Path, kind: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a file written by `save_verified`, refusing it unless its sha256 matches."""
    path = Path(path)
    mpath = manifest_path(path)
    for p in (path, mpath):
        if not p.is_file():
            raise IntegrityError(f"{p}: file not found")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{mpath}: manifest is not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or "sha256" not in manifest:
        raise IntegrityError(f"{mpath}: manifest has no 'sha256' field")
    if kind is not None and manifest.get("kind") != kind:
        raise IntegrityError(f"{mpath}: expected kind {kind!r}, found {manifest.get('kind')!r}")
    actual = sha256_file(path)
    if actual != manifest["sha256"]:
        raise IntegrityError(
            f"{path}: sha256 mismatch (manifest says {manifest['sha256']}, file has {actual}); "
            "the file is corrupted or belongs to another manifest"
        )
    try:
        tensors = load_file(str(path))
    except SafetensorError as e:  # only reachable if the manifest itself was forged
        raise IntegrityError(f"{path}: not a readable safetensors file ({e})") from e
    return tensors, manifest


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], where: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise IntegrityError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
