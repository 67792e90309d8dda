"""A release folder (everything one version needs to run) and loading it as a ready model.

A version is the backbone plus every delta of its chain, oldest first (atlas_core.chain).
Its folder holds the chain's files with their manifests and names the backbone by reference:

    manifest.json                  name, model, line, skill, backbone {name, revision, weights_sha256
                                   [, bundle_weights_sha256]}, chain [{name, skill, method, adapter,
                                   adapter_sha256, atlas, atlas_sha256}]
    manifest.sha256                the sha256 of manifest.json's bytes, as `sha256sum` writes it
    deltas/<i>-<name>.safetensors  each delta (+ .json manifest with its sha256), oldest first
    atlases/<sha16>.safetensors    each atlas a residual of the chain routes with (+ .json)
    backbone/                      optional: the backbone's own files, for air-gapped serving
    answers.jsonl                  what the version answered when it was evaluated

registry.publish (a ledger version; MLflow's artifacts/release) and atlas_core.export write it:
every other file first, then manifest.sha256, then manifest.json (`write_manifest`). So a folder
with a manifest.json is complete, and a crash between the two leaves a pair that does not verify.

`load_folder` verifies all of it before anything runs:
  - manifest.json against manifest.sha256, since the manifest decides which model the folder is
    (dropping a delta of its chain or naming another backbone must not load as another model).
    A folder without the sidecar was written before it existed: refused unless the caller passes
    require_sidecar=False (export it again instead). The sidecar travels with the folder, so the
    loaders that know the release from elsewhere check the manifest against that record too:
    flows.serving against the ledger (and the chain against the ledger's) and against the MLflow
    model version's `manifest_sha256` tag;
  - every delta and atlas against both its own manifest and the folder's manifest (so a file
    swapped together with its manifest is refused too);
  - the backbone's revision, and its weights against `weights_sha256` (`bundle_weights_sha256`
    for a bundled backbone saved at export); a manifest without it is refused unless the caller
    passes verify_backbone=False.
Each refusal is an IntegrityError naming the file and the sha256 it was expected to have. The
chain is then attached to the model with hooks that stay until `LoadedRelease.detach()`.
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
from .io import IntegrityError, atomic_write_bytes, json_bytes, manifest_path, sha256_bytes, sha256_file

MANIFEST = "manifest.json"
SIDECAR = "manifest.sha256"
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


def write_manifest(folder: str | Path, manifest: dict) -> str:
    """Write the folder's manifest.json and, just before it, its sidecar; returns the sha256.
    Call it last, when every file the manifest lists is in place (see the module docstring)."""
    data = json_bytes(manifest)
    sha256 = sha256_bytes(data)
    write_sidecar(folder, sha256)
    atomic_write_bytes(Path(folder) / MANIFEST, data)
    return sha256


def write_sidecar(folder: str | Path, sha256: str) -> None:
    """manifest.sha256: one line as `sha256sum` writes it (`sha256sum -c manifest.sha256` checks it)."""
    atomic_write_bytes(Path(folder) / SIDECAR, f"{sha256}  {MANIFEST}\n".encode())


def manifest_sha256(folder: str | Path) -> str:
    """The sha256 of the folder's manifest.json bytes."""
    path = Path(folder) / MANIFEST
    try:
        return sha256_file(path)
    except OSError as e:
        raise IntegrityError(f"{path}: cannot be read ({e.strerror}); is {folder} a release folder?") from e


def check_manifest(
    folder: str | Path, expected: str, recorded_by: str, remedy: str = "export the release again"
) -> None:
    """Refuse the folder's manifest.json unless its bytes have the sha256 that `recorded_by` (the
    ledger, an MLflow tag, the sidecar) expects: any edit of it makes the folder another model."""
    actual = manifest_sha256(folder)
    if actual != expected:
        raise IntegrityError(
            f"{Path(folder) / MANIFEST}: {recorded_by} expects sha256 {expected}, the file has "
            f"{actual}: the manifest was edited after the release was written (another chain "
            f"or backbone is another model); {remedy}"
        )


def check_sidecar(folder: str | Path, required: bool = True) -> None:
    """Refuse the folder's manifest.json unless it matches manifest.sha256; a folder without the
    sidecar (written before it existed) is refused too, unless `required` is False."""
    digest = manifest_sha256(folder)  # first: a folder with no manifest.json is no release folder
    path = Path(folder) / SIDECAR
    if not path.exists():
        if not required:
            return
        raise IntegrityError(
            f"{path}: missing, so nothing shows that {MANIFEST} (sha256 {digest}) is the one "
            f"the release was written with; {folder} predates manifest sidecars: export it again "
            "(`atlas export VERSION --format folder`), or load it with require_sidecar=False"
        )
    try:
        fields = path.read_text().split()
    except (OSError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{path}: cannot be read ({e})") from e
    if len(fields) != 2 or fields[1] != MANIFEST or len(fields[0]) != 64:
        raise IntegrityError(f"{path}: expected one line '<sha256>  {MANIFEST}', got {' '.join(fields)[:120]!r}")
    check_manifest(folder, fields[0], path.name)


def read_manifest(folder: str | Path) -> dict:
    """The folder's manifest.json, parsed (not verified: `check_sidecar` and `load_chain` do that)."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except OSError as e:
        raise IntegrityError(f"{path}: cannot be read ({e.strerror}); is {folder} a release folder?") from e
    except ValueError as e:
        raise IntegrityError(f"{path}: not valid JSON ({e})") from e
    for key in ("name", "backbone", "chain"):
        if key not in manifest:
            raise IntegrityError(
                f"{path}: field {key!r} missing (a folder written before release format "
                f"{RELEASE_FORMAT}; export it again with `atlas export`)"
            )
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


def load_chain(folder: str | Path, require_sidecar: bool = True) -> tuple[dict, Chain]:
    """The folder's manifest (checked against its sidecar) and its chain, every delta and atlas
    verified by sha256. `require_sidecar=False` accepts a folder written before sidecars."""
    folder = Path(folder)
    check_sidecar(folder, required=require_sidecar)
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


def load_folder(
    folder: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    backbone_loader: Callable[[str, str | torch.dtype], Backbone] | None = None,
    verify_backbone: bool = True,
    require_sidecar: bool = True,
) -> LoadedRelease:
    """The release in `folder` as a ready model + tokenizer (eval mode, frozen, chain attached).

    The backbone comes from `folder/backbone` when bundled, else from `backbone_loader(name, dtype)`
    (default: atlas_core.backbone.load_backbone, which never downloads); its revision and weights
    must be the ones the release was trained on. The two opt-outs load what cannot be verified,
    on the caller's word: `verify_backbone=False` a backbone whose weights the manifest does not
    name (or does not match), `require_sidecar=False` a folder written before manifest sidecars.
    """
    folder = Path(folder)
    manifest, chain = load_chain(folder, require_sidecar)
    ref = manifest["backbone"]
    bundled = folder / "backbone"
    # A bundle saved from a model built in-process has files of its own, recorded at export.
    expected = (ref.get("bundle_weights_sha256") if bundled.is_dir() else None) or ref.get("weights_sha256")
    if verify_backbone and not expected:
        raise IntegrityError(
            f"{folder / MANIFEST}: names no weights_sha256 for backbone {ref['name']!r}"
            + (" (nor bundle_weights_sha256 for backbone/)" if bundled.is_dir() else "")
            + ", so its weights cannot be verified; pass verify_backbone=False to load it anyway"
        )
    if bundled.is_dir():
        bb = load_backbone(str(bundled), dtype, revision=ref.get("revision"))
        bb.name, bb.revision = ref["name"], ref.get("revision")
    else:
        bb = (backbone_loader or load_backbone)(ref["name"], dtype)
        if ref.get("revision") and bb.revision != ref["revision"]:
            raise IntegrityError(
                f"{folder / MANIFEST}: backbone {ref['name']!r} is at revision {bb.revision}, "
                f"the release was trained on {ref['revision']}"
            )
    if verify_backbone and weights_sha256(bb.model) != expected:
        raise IntegrityError(
            f"{folder / MANIFEST}: backbone {ref['name']!r} weights do not match weights_sha256 {expected}"
        )
    if device is not None:
        bb.model.to(device)
    release = LoadedRelease(bb.model, bb.tokenizer, manifest, chain, bb)
    release.attach()
    return release
