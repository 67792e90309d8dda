"""Using a release: `load_release` resolves a version and returns it as a ready model.

    from flows import load_release
    r = load_release("smollm2-135m.code", "champion")      # or a line: load_release("code")
    r.model, r.tokenizer                                     # transformers objects, chain attached
    load_release("models:/smollm2-135m.code@champion")     # straight from the MLflow registry
    load_release("exports/v2")                              # a folder from `atlas export --format folder`

A ledger version is written once as a release folder (atlas_core.release) in the state's
cache and loaded from there; an MLflow model is downloaded and loaded from its
`artifacts/release`. Every path ends in atlas_core.release.load_folder, which verifies each
delta and atlas by sha256 and the backbone by revision and weights before attaching.
"""
from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


_URI_SCHEMES = ("models:/", "runs:/", "mlflow-artifacts:/", "file:/")


def load_release(line_or_model: str, version: str = "champion", *, dtype="auto", device=None,
                 backbone: str | None = None,
                 verify_backbone: bool = True):
    """A version as an atlas_core.release.LoadedRelease (`.model`, `.tokenizer`, `.manifest`).

    `line_or_model`: a registered model ("smollm2-135m.code"), a line of `backbone` (default: the
    embedded default backbone), an MLflow model URI, or a release folder. `version` (ledger
    only): "champion" (the base while nobody holds it), "base", "candidate", a version name,
    "mlflow:<n>" or "#<ledger id>". `dtype` ("auto", "float32", "bfloat16" or a torch dtype) and
    `device` (e.g. "cuda") as in transformers' from_pretrained.
    """
    from atlas_core.release import load_folder
    from evaluation.tiny import load_model

    with release_folder(line_or_model, version, backbone) as folder:
        return load_folder(folder, dtype=dtype, device=device, backbone_loader=load_model,
                           verify_backbone=verify_backbone)


@contextmanager
def release_folder(line_or_model: str, version: str = "champion", backbone: str | None = None) -> Iterator[Path]:
    """The local release folder of a version: a ledger version's is written once into the state's
    cache and reused (and verified again on every load); an MLflow model is downloaded afresh, as
    MLflow itself does, into a temporary folder removed when the block ends."""
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
            raise LedgerError(f"{line_or_model!r}: no registered model or line of that name "
                              "(`atlas status` lists them; or pass an MLflow URI or a release folder)") from None
    v = resolve_version(p.ledger, model.id, version)
    folder = p.state / "cache" / "releases" / model.name / f"{v.name}-{v.id}"
    if not (folder / "manifest.json").is_file():  # manifest.json is written last: its presence means complete
        shutil.rmtree(folder, ignore_errors=True)
        with atomic_folder(folder) as tmp:
            write_release_folder(p.ledger, p.store, v.id, tmp)
    return folder


def _download(p, uri: str, dest: Path) -> Path:
    """An MLflow model (models:/<name>@<alias>, models:/<name>/<n>) or artifact URI, downloaded into `dest`."""
    import mlflow.artifacts

    if uri.startswith("models:/"):
        name, sep, ref = uri.removeprefix("models:/").rpartition("@")
        if not sep:
            name, _, ref = uri.removeprefix("models:/").rpartition("/")
        if not name or not ref:
            raise ValueError(f"{uri}: expected models:/<name>@<alias> or models:/<name>/<version>")
        return p.bridge.download_version(name, ref, dest)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dest),
                                                    tracking_uri=p.bridge.config.tracking_uri))
