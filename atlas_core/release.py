"""A release folder (everything one version needs to run) and loading it as a ready model.

A version is the backbone plus every delta of its chain, oldest first (atlas_core.chain).
Its folder holds the chain's files with their manifests and names the backbone by reference:

    manifest.json                  name, model, line, skill, backbone {name, revision, weights_sha256},
                                   chain [{name, skill, method, adapter, adapter_sha256, atlas, atlas_sha256}]
    deltas/<i>-<name>.safetensors  each delta (+ .json manifest with its sha256), oldest first
    atlases/<sha16>.safetensors    each atlas a residual of the chain routes with (+ .json)
    backbone/                      optional: the backbone's own files, for air-gapped serving
    answers.jsonl                  what the version answered when it was evaluated

registry.publish writes it; `load_folder` reads it: every file is checked against both its
own manifest and the folder's manifest (so a file swapped together with its manifest is
refused too), the backbone's weights against `weights_sha256`, and the chain is attached to
the model with hooks that stay until `LoadedRelease.detach()`.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .atlas import Atlas
from .backbone import Backbone, load_backbone, weights_sha256
from .chain import Chain, load_delta
from .io import IntegrityError, manifest_path

MANIFEST = "manifest.json"
RELEASE_FORMAT = 2


@dataclass
class LoadedRelease:
    """A version ready to run: `model` behaves as the version until `detach()`."""

    model: nn.Module
    tokenizer: object
    manifest: dict
    chain: Chain
    backbone: Backbone
    _stack: ExitStack = field(default_factory=ExitStack, repr=False)

    @property
    def name(self) -> str:
        return self.manifest["name"]

    def detach(self) -> None:
        """Remove the chain's hooks: the model is the plain backbone again, bit-identical."""
        self._stack.close()
        self.model.__dict__.pop(_HOOKS, None)

    def attach(self) -> None:
        """Attach the chain (again); `load_folder` returns the release attached."""
        self._stack = ExitStack()
        self._stack.enter_context(self.chain.attached(self.model))
        # The hooks live as long as the model, not as long as this object: the chain's context
        # managers would remove them when this object is collected (`m = load_folder(...).model`).
        self.model.__dict__[_HOOKS] = self._stack


_HOOKS = "_atlas_release_hooks"


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except OSError as e:
        raise IntegrityError(f"{path}: cannot be read ({e.strerror}); is {folder} a release folder?") from e
    except ValueError as e:
        raise IntegrityError(f"{path}: not valid JSON ({e})") from e
    for key in ("name", "backbone", "chain"):
        if key not in manifest:
            raise IntegrityError(f"{path}: field {key!r} missing (a folder written before release format "
                                 f"{RELEASE_FORMAT}; export it again with `atlas export`)")
    return manifest


def _checked(folder: Path, relative: str, sha256: str) -> Path:
    """A file of the folder whose own manifest records the sha256 the release manifest expects."""
    path = folder / relative
    try:
        recorded = json.loads(manifest_path(path).read_text()).get("sha256")
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{manifest_path(path)}: unreadable manifest ({e})") from e
    if recorded != sha256:
        raise IntegrityError(f"{path}: the release expects sha256 {sha256}, the file's manifest says {recorded}")
    return path  # the file's own bytes are checked against that sha256 when it is loaded


def load_chain(folder: str | Path) -> tuple[dict, Chain]:
    """The folder's manifest and its chain, every delta and atlas verified by sha256."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    atlases: dict[str, Atlas] = {}

    def atlas_for(sha: str) -> Atlas:
        entry = next((d for d in manifest["chain"] if d.get("atlas_sha256") == sha and d.get("atlas")), None)
        if entry is None:
            raise IntegrityError(f"{folder / MANIFEST}: no atlas file listed for atlas sha256 {sha}")
        if sha not in atlases:
            atlases[sha] = Atlas.load(_checked(folder, entry["atlas"], sha))
        return atlases[sha]

    deltas = [load_delta(_checked(folder, d["adapter"], d["adapter_sha256"]), atlas_for) for d in manifest["chain"]]
    return manifest, Chain(deltas)


def load_folder(folder: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                backbone_loader: Callable[[str, str | torch.dtype], Backbone] | None = None,
                verify_backbone: bool = True) -> LoadedRelease:
    """The release in `folder` as a ready model + tokenizer (eval mode, frozen, chain attached).

    The backbone comes from `folder/backbone` when bundled, else from `backbone_loader(name, dtype)`
    (default: atlas_core.backbone.load_backbone, which never downloads); its revision and weights
    must be the ones the release was trained on.
    """
    folder = Path(folder)
    manifest, chain = load_chain(folder)
    ref = manifest["backbone"]
    bundled = folder / "backbone"
    if bundled.is_dir():
        bb = load_backbone(str(bundled), dtype, revision=ref.get("revision"))
        bb.name, bb.revision = ref["name"], ref.get("revision")
    else:
        bb = (backbone_loader or load_backbone)(ref["name"], dtype)
        if ref.get("revision") and bb.revision != ref["revision"]:
            raise IntegrityError(f"{folder / MANIFEST}: backbone {ref['name']!r} is at revision {bb.revision}, "
                                 f"the release was trained on {ref['revision']}")
    # A bundle saved from a model built in-process has files of its own, recorded at export.
    expected = ref.get("bundle_weights_sha256") if bundled.is_dir() else None
    expected = expected or ref.get("weights_sha256")
    if verify_backbone and expected and weights_sha256(bb.model) != expected:
        raise IntegrityError(f"{folder / MANIFEST}: backbone {ref['name']!r} weights do not match "
                             f"weights_sha256 {expected}")
    if device is not None:
        bb.model.to(device)
    release = LoadedRelease(bb.model, bb.tokenizer, manifest, chain, bb)
    release.attach()
    return release
