"""Using a release: `load_release` resolves a version and returns it as a ready model.

    from flows import load_release
    r = load_release("smollm2-135m.code", "champion")      # or a line: load_release("code")
    r.model, r.tokenizer                                     # transformers objects, chain attached
    load_release("models:/smollm2-135m.code@champion")     # straight from the MLflow registry
    load_release("exports/v2")                              # a folder from `atlas export --format folder`

A ledger version is written once as a release folder (atlas_core.release) in the state's
cache and loaded from there; an MLflow model is downloaded and loaded from its
`artifacts/release`. Every path ends in atlas_core.release.load_folder, which verifies the
manifest against its sidecar, each delta and atlas by sha256 and the backbone by revision and
weights before attaching. Before that, a folder is checked against what recorded the release:
a cached ledger folder's manifest.json against the sha256 the ledger recorded and its chain
against the ledger's (an edited cache is refused, never silently rewritten), a `models:/`
download's against the model version's `manifest_sha256` tag.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_URI_SCHEMES = ("models:/", "runs:/", "mlflow-artifacts:/", "file:/")


def load_release(
    line_or_model: str,
    version: str = "champion",
    *,
    dtype="auto",
    device=None,
    backbone: str | None = None,
    verify_backbone: bool = True,
    require_sidecar: bool = True,
):
    """A version as an atlas_core.release.LoadedRelease (`.model`, `.tokenizer`, `.manifest`).

    `line_or_model`: a registered model ("smollm2-135m.code"), a line of `backbone` (default: the
    embedded default backbone), an MLflow model URI, or a release folder. `version` (ledger
    only): "champion" (the base while nobody holds it), "base", "candidate", a version name,
    "mlflow:<n>" or "#<ledger id>". `dtype` ("auto", "float32", "bfloat16" or a torch dtype) and
    `device` (e.g. "cuda") as in transformers' from_pretrained. `verify_backbone=False` and
    `require_sidecar=False` load what cannot be verified (atlas_core.release.load_folder).
    """
    from atlas_core.release import load_folder
    from evaluation.tiny import load_model

    with release_folder(line_or_model, version, backbone) as folder:
        return load_folder(
            folder,
            dtype=dtype,
            device=device,
            backbone_loader=load_model,
            verify_backbone=verify_backbone,
            require_sidecar=require_sidecar,
        )


@contextmanager
def release_folder(line_or_model: str, version: str = "champion", backbone: str | None = None) -> Iterator[Path]:
    """The local release folder of a version: a ledger version's is written once into the state's
    cache and reused (and verified again on every load); an MLflow model is downloaded afresh, as
    MLflow itself does, into a temporary folder removed when the block ends. A ledger or `models:/`
    folder is checked against the ledger's or the model version's record here; every folder is
    checked against its own sidecar by atlas_core.release.load_folder."""
    if Path(line_or_model).expanduser().is_dir():
        yield _unwrapped(Path(line_or_model).expanduser())
        return
    from .platform import open_platform

    p, tmp = open_platform(), None
    try:
        if line_or_model.startswith(_URI_SCHEMES):
            (p.state / "cache").mkdir(parents=True, exist_ok=True)
            tmp = tempfile.TemporaryDirectory(prefix="atlas-release-", dir=p.state / "cache")
            folder = _unwrapped(_download(p, line_or_model, Path(tmp.name)))
        else:
            folder = _from_ledger(p, line_or_model, version, backbone)
    except BaseException:
        if tmp is not None:
            tmp.cleanup()
        raise
    finally:
        p.close()
    try:
        yield folder
    finally:
        if tmp is not None:
            tmp.cleanup()


def _unwrapped(folder: Path) -> Path:
    """An MLflow pyfunc model keeps the release folder under artifacts/release."""
    inner = folder / "artifacts" / "release"
    return inner if (folder / "MLmodel").is_file() and inner.is_dir() else folder


def _from_ledger(p, line_or_model: str, version: str, backbone: str | None) -> Path:
    from atlas_core.backbone import DEFAULT_BACKBONE
    from atlas_core.io import atomic_folder
    from registry import LedgerError, get_model, model_name_for, resolve_version, write_release_folder

    try:
        model = get_model(p.ledger, line_or_model)
    except LedgerError:
        try:
            model = get_model(p.ledger, model_name_for(backbone or DEFAULT_BACKBONE, line_or_model))
        except LedgerError:
            raise LedgerError(
                f"{line_or_model!r}: no registered model or line of that name "
                "(`atlas status` lists them; or pass an MLflow URI or a release folder)"
            ) from None
    v = resolve_version(p.ledger, model.id, version)
    folder = p.state / "cache" / "releases" / model.name / f"{v.name}-{v.id}"
    if not (folder / "manifest.json").is_file():  # manifest.json is written last: its presence means complete
        shutil.rmtree(folder, ignore_errors=True)
        with atomic_folder(folder) as tmp:
            write_release_folder(p.ledger, p.store, v.id, tmp)  # records the manifest's sha256 the first time
    _check_against_ledger(p.ledger, v.id, folder)
    return folder


def _check_against_ledger(ledger, version_id: int, folder: Path) -> None:
    """Refuse a cached folder that is not the ledger's release: its chain must be the ledger's
    version_chain (adapter sha256s, in order) and its manifest.json must have the sha256 the
    ledger recorded. An edited cache is refused, never rewritten behind the user's back."""
    from atlas_core.io import IntegrityError
    from atlas_core.release import MANIFEST, SIDECAR, check_manifest, read_manifest, write_sidecar
    from registry import release_manifest_sha256, version_chain

    path, remedy = folder / MANIFEST, f"remove {folder} to write it again from the ledger"
    # Computed from the ledger and recorded now for a folder cached before the ledger recorded it.
    expected = release_manifest_sha256(ledger, version_id, str(path))
    want = [d.adapter_sha256 for d in version_chain(ledger, version_id)]
    try:
        have = [d.get("adapter_sha256") for d in read_manifest(folder)["chain"]]
    except (IntegrityError, TypeError, AttributeError):
        have = None
    if have != want:
        raise IntegrityError(
            f"{path}: its chain is not the ledger's {len(want)} delta(s) in order (adapter "
            f"sha256 {', '.join(w[:12] for w in want) or 'none'}); the ledger expects manifest "
            f"sha256 {expected}; {remedy}"
        )
    check_manifest(folder, expected, "the ledger", remedy)
    if not (folder / SIDECAR).exists():  # cached before sidecars; its manifest is the ledger's, checked above
        write_sidecar(folder, expected)


def _download(p, uri: str, dest: Path) -> Path:
    """An MLflow model (models:/<name>@<alias>, models:/<name>/<n>) or artifact URI, downloaded into `dest`;
    a model version's release folder is checked against the version's `manifest_sha256` tag."""
    import mlflow.artifacts

    from atlas_core.errors import InputError

    if uri.startswith("models:/"):
        name, sep, ref = uri.removeprefix("models:/").rpartition("@")
        if not sep:
            name, _, ref = uri.removeprefix("models:/").rpartition("/")
        if not name or not ref:
            raise InputError(f"{uri}: expected models:/<name>@<alias> or models:/<name>/<version>")
        # The number first: the files and the tag must be one version's, even if the alias moves meanwhile.
        number = ref if ref.isdigit() else str(p.bridge.client.get_model_version_by_alias(name, ref).version)
        folder = p.bridge.download_version(name, number, dest)
        _check_against_tag(p.bridge, name, number, folder)
        return folder
    return Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=uri, dst_path=str(dest), tracking_uri=p.bridge.config.tracking_uri
        )
    )


def _check_against_tag(bridge, name: str, number: str, folder: Path) -> None:
    """Refuse a downloaded model version whose manifest.json is not the one its `manifest_sha256` tag
    names. A version published before the tag existed has none: its folder's sidecar decides."""
    from atlas_core.release import SIDECAR, check_manifest, write_sidecar
    from registry import MANIFEST_TAG

    expected = bridge.version_tags(name, number).get(MANIFEST_TAG)
    if expected is None:
        return
    release = _unwrapped(folder)
    check_manifest(
        release,
        expected,
        f"MLflow model version {name}/{number} (tag {MANIFEST_TAG})",
        "the version's files were changed after it was published",
    )
    if not (release / SIDECAR).exists():  # published before sidecars; the tag vouches for this copy
        write_sidecar(release, expected)
