"""submit_candidate: an adapter trained elsewhere joins a line as a candidate version.

    atlas submit DIR --line L [--parent champion|VERSION] [--skill S] [--name N]

The documented way to train on top of a release with your own tools:

    release = load_release("smollm2-135m.assistant", "champion")      # the parent, chain attached
    model = peft.get_peft_model(release.model, LoraConfig(...))      # or TRL's SFTTrainer
    ... train ...
    model.save_pretrained("my-adapter")                              # adapter_config.json + safetensors
    atlas submit my-adapter --line assistant --skill code            # then: atlas gate check VERSION ...

What can be submitted (`source`):
- a PEFT LoRA adapter folder (any modules of any layers, per-module rank and alpha): converted to
  one frozen delta (atlas_core.peft_lora); options the chain cannot apply exactly are refused;
- the platform's own delta file (`*.safetensors` + its `.json` manifest, any kind; an ATLAS
  residual's atlas must be one the ledger holds);
- a release folder whose chain is the parent's plus one delta (that delta is submitted, with
  the atlas it routes with, which is recorded if the ledger does not hold it yet);
- an MLflow model URI (`models:/...`, `runs:/...`) holding either of the folders above.

Everything is checked before anything is written: the adapter's modules and shapes against the
line's backbone, the backbone's revision and weights against the ledger, the base model name
and revision the adapter records, and the whole chain (parent + new delta) attached and run
once. The delta is stored by sha256, recorded as a finished training run of method `<kind>`
whose config says where it came from (`submitted`: source, sha256), and registered as a version
whose parent is `parent`. Submitting the same delta onto the same parent again (in any of the
forms above) returns the version recorded the first time.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from atlas_core.errors import InputError

from .config import digest


@dataclass(frozen=True)
class Submitted:
    """A submitted adapter as a candidate version of a line."""

    model: str  # the line's registered model
    version: str
    version_id: int
    parent: str
    kind: str  # the delta's kind (peft-lora, weight-lora, adapter, ...)
    sha256: str  # of the submitted weights file
    new: bool  # False: the same adapter was already submitted onto this parent


@dataclass(frozen=True)
class _Parent:
    """What the adapter was trained on top of: a version of the line, or the bare backbone of a
    line that does not exist yet (created when the adapter is recorded)."""

    name: str
    version: object  # registry.VersionInfo; None for a new line
    adapter_sha256s: tuple[str, ...]  # its chain's deltas, oldest first
    chain: object  # atlas_core.chain.Chain, every delta verified


def submit_candidate(
    source: str,
    line: str,
    parent: str = "champion",
    skill: Optional[str] = None,
    name: Optional[str] = None,
    backbone: Optional[str] = None,
) -> Submitted:
    """Check `source` against the line's backbone and record it as a candidate version on top of
    `parent`. A line that does not exist yet is started on `backbone` (its first adapter sits on the base)."""
    from atlas_core.backbone import DEFAULT_BACKBONE

    from .platform import PlatformRef
    from .resources import scope

    with scope(PlatformRef.from_environment()) as res:
        model = _line(res.ledger, line, backbone)
        bb = res.load_backbone(model.backbone if model else backbone or DEFAULT_BACKBONE, "float32")
        return record_submitted(res, bb, model, source, line, parent, skill, name)


def record_submitted(
    res,
    bb,
    model,
    source: str,
    line: str,
    parent: str = "champion",
    skill: Optional[str] = None,
    name: Optional[str] = None,
    origin: Optional[dict] = None,
    run_config: Optional[dict] = None,
) -> Submitted:
    """submit_candidate inside an open scope, with the line's backbone `bb` loaded (`model`: the
    line, None for a new one). `origin` replaces what the run records about where the delta came
    from; `run_config` adds to the run's config (both: a squash, flows/squash.py)."""
    from dataclasses import replace

    with tempfile.TemporaryDirectory(prefix="atlas-submit-") as tmp:
        weights = _check_backbone(model, bb)
        base = _parent(res, model, parent, name)
        found = _delta_file(source, bb, Path(tmp), base, res.platform)
        found = replace(found, origin=found.origin | (origin or {}))
        atlas = _atlas_of(res, found)
        delta = _verified_on_chain(found.path, base, bb.model, atlas)
        return _record(
            res.platform,
            model or line,
            bb,
            weights,
            base,
            found,
            atlas,
            delta,
            skill or (model.line if model else line),
            name,
            run_config or {},
        )


def _line(ledger, line: str, backbone: Optional[str]):
    """The line named (registered model name, or a line of `backbone`); None if it does not exist yet."""
    from atlas_core.backbone import DEFAULT_BACKBONE
    from registry import LedgerError, get_model, model_name_for, require_name

    for candidate in (line, model_name_for(backbone or DEFAULT_BACKBONE, line)):
        try:
            return get_model(ledger, candidate)
        except LedgerError:
            pass
    require_name(line, "--line")  # a new line: its name must be one the ledger takes
    return None


def _check_backbone(model, bb) -> str:
    """The loaded backbone is at the line's revision; returns its weights' sha256 (checked against
    the ledger's, where recorded, as the first step of recording)."""
    from atlas_core.backbone import weights_sha256

    if model is not None and bb.revision != model.revision:
        raise InputError(
            f"backbone {model.backbone!r} loads at revision {bb.revision}, the line {model.name} "
            f"was recorded at {model.revision}"
        )
    return weights_sha256(bb.model)


def _parent(res, model, ref: str, name: Optional[str]) -> _Parent:
    """The parent version, checked (active; the new version's name free), its chain verified."""
    from atlas_core.chain import Chain
    from registry import list_versions, resolve_version

    if model is None:
        if ref not in ("base", "champion"):
            raise InputError(f"--parent {ref!r}: the line has no versions yet; its first adapter sits on the base")
        return _Parent("base", None, (), Chain([]))
    v = resolve_version(res.ledger, model.id, ref)
    if v.status == "retired":
        raise InputError(f"--parent {ref!r}: {v.name} was rolled back (retired); re-nominate it first")
    if name is not None and name in {x.name for x in list_versions(res.ledger, model.id)}:
        raise InputError(f"--name {name!r}: a version of {model.name} has that name already; choose another")
    applied = res.resolve_applied(v)
    return _Parent(v.name, v, tuple(d.adapter_sha256 for d in applied.deltas), res.chain(applied))


@dataclass(frozen=True)
class _Found:
    """A submitted delta as a verified file with its manifest, wherever it came from."""

    path: Path
    kind: str
    origin: dict  # source, sha256 of what was submitted, format
    atlas_sha256: Optional[str] = None  # the atlas an ATLAS residual routes with
    atlas_file: Optional[Path] = None  # that atlas's file, when the source carries it (a release folder)


def _delta_file(source: str, bb, tmp: Path, parent: _Parent, platform) -> _Found:
    """The delta of any accepted source, verified by sha256 (a PEFT folder converted first)."""
    from dataclasses import replace

    from atlas_core.io import load_verified
    from atlas_core.peft_lora import CONFIG_FILE, from_peft_folder

    if source.startswith(("models:/", "runs:/")):
        found = _delta_file(str(_downloaded(source, tmp, platform)), bb, tmp, parent, platform)
        return replace(found, origin=found.origin | {"source": source})
    path = Path(source).expanduser()
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        _check_base_name(path, bb)
        lora_set = from_peft_folder(path, bb.model)
        out = tmp / "delta.safetensors"
        lora_set.save(out)
        return _Found(
            out,
            lora_set.kind,
            {"source": str(path.resolve()), "sha256": lora_set.source["weights_sha256"], "format": "peft"},
        )
    if path.is_dir() and (path / "manifest.json").is_file():
        return _from_release_folder(path, parent)
    if path.is_file() and path.with_suffix(".json").is_file():
        _, manifest = load_verified(path)  # sha256 checked against its manifest
        return _Found(
            path,
            str(manifest.get("kind")),
            {"source": str(path.resolve()), "sha256": manifest["sha256"], "format": "delta"},
            manifest.get("atlas_sha256"),
        )
    if path.is_dir():
        raise InputError(f"{path}: no {CONFIG_FILE} (a PEFT adapter folder) and no manifest.json (a release folder)")
    raise InputError(
        f"{source}: expected a PEFT adapter folder, a delta file (.safetensors with its .json "
        "manifest), a release folder or an MLflow model URI (models:/..., runs:/...)"
    )


def _check_base_name(folder: Path, bb) -> None:
    """A PEFT adapter names the model it was trained on; where it does, it must be this backbone."""
    from atlas_core.peft_lora import read_peft_config

    config = read_peft_config(folder)
    name, known = config.get("base_model_name_or_path"), {bb.name, str(getattr(bb.model, "name_or_path", "") or "")}
    if name and name not in known:
        raise InputError(
            f"{folder / 'adapter_config.json'}: base_model_name_or_path {name!r} is not the line's "
            f"backbone {bb.name!r}; train on load_release(LINE, PARENT).model"
        )
    revision = config.get("revision")
    if revision and revision != bb.revision:
        raise InputError(
            f"{folder / 'adapter_config.json'}: revision {revision!r} is not the line's backbone revision {bb.revision}"
        )


def _from_release_folder(folder: Path, parent: _Parent) -> _Found:
    """A release folder whose chain is the parent's plus one delta: that delta (verified by sha256)."""
    from atlas_core.release import MANIFEST, load_chain

    manifest, _ = load_chain(folder)  # every delta and atlas verified against both manifests
    have = [d["adapter_sha256"] for d in manifest["chain"]]
    if len(have) != len(parent.adapter_sha256s) + 1 or tuple(have[:-1]) != parent.adapter_sha256s:
        raise InputError(
            f"{folder / MANIFEST}: its chain ({len(have)} deltas) is not the parent "
            f"{parent.name}'s ({len(parent.adapter_sha256s)} deltas) plus one; submit onto its own "
            "parent with --parent"
        )
    entry = manifest["chain"][-1]
    path = folder / entry["adapter"]
    atlas = folder / entry["atlas"] if entry.get("atlas") else None
    return _Found(
        path,
        str(_manifest(path).get("kind")),
        {"source": str(folder.resolve()), "sha256": entry["adapter_sha256"], "format": "release"},
        entry.get("atlas_sha256"),
        atlas,
    )


def _atlas_of(res, found: _Found):
    """The atlas a submitted residual routes with: from the source (a release folder carries it,
    verified), else one the ledger already holds (e.g. the line's own); None for other kinds."""
    from atlas_core.atlas import Atlas
    from registry import find_atlas_file

    if found.atlas_sha256 is None:
        return None
    if found.atlas_file is not None:
        atlas = Atlas.load(found.atlas_file)
    else:
        info = find_atlas_file(res.ledger, found.atlas_sha256)
        if info is None:
            raise InputError(
                f"{found.path}: it routes with atlas sha256 {found.atlas_sha256[:16]}..., which the "
                "ledger does not hold; submit a release folder, which carries its atlas"
            )
        atlas = res.stored_atlas(info.id, found.atlas_sha256)
    if atlas.sha256 != found.atlas_sha256:
        raise InputError(f"{found.path}: expects atlas sha256 {found.atlas_sha256}, the atlas found is {atlas.sha256}")
    return atlas


def _manifest(path: Path) -> dict:
    import json

    return json.loads(path.with_suffix(".json").read_text())


def _downloaded(uri: str, dest: Path, platform) -> Path:
    """An MLflow model or run artifact, downloaded; the PEFT or release folder inside it."""
    from atlas_core.peft_lora import CONFIG_FILE

    from .serving import _download, _unwrapped

    root = _unwrapped(_download(platform, uri, dest / "download"))
    found = [c.parent for c in root.rglob(CONFIG_FILE)] or [c.parent for c in root.rglob("manifest.json")]
    if len(found) != 1:
        raise InputError(
            f"{uri}: expected one PEFT adapter folder ({CONFIG_FILE}) or release folder inside, found {len(found)}"
        )
    return found[0]


@torch.no_grad()
def _verified_on_chain(path: Path, parent: _Parent, model, atlas):
    """The delta loaded (sha256 verified; a residual with the atlas it was trained with), attached
    after the parent's chain and run once: every module it names must exist with its shapes (a
    residual's layer and width), and the logits must be finite."""
    from atlas_core.chain import load_delta

    delta = load_delta(path, lambda sha: atlas)
    try:
        with parent.chain.then(delta).attached(model):
            ids = torch.arange(3, 11).unsqueeze(0) % model.config.vocab_size  # (1, 8)
            logits = model(ids).logits
    except (ValueError, RuntimeError) as e:
        raise InputError(f"{path}: does not apply to the line's backbone after {parent.name}: {e}") from None
    if not torch.isfinite(logits).all():
        raise InputError(f"{path}: the model gives non-finite logits with this adapter")
    return delta


def _record(
    p,
    model,
    bb,
    weights: str,
    parent: _Parent,
    found: _Found,
    atlas,
    delta,
    skill: str,
    name: Optional[str],
    run_config: dict,
) -> Submitted:
    """Store the delta (and an atlas the ledger does not hold yet), record it as a finished run with
    one checkpoint, register the version (`model`: the line, or the name of a line to start on `bb`)."""
    from atlas_core.io import sha256_file
    from registry import (
        base_version,
        end_mlflow_run,
        ensure_backbone,
        ensure_model,
        find_training_run,
        log_checkpoint,
        record_checkpoint,
        register_version,
        run_checkpoints,
        run_versions,
        start_training_run,
    )

    ledger, path, kind, origin = p.ledger, found.path, found.kind, found.origin
    if isinstance(model, str):  # a new line: the backbone, the line and its base version, get-or-create
        model = ensure_model(ledger, ensure_backbone(ledger, bb.name, bb.revision, weights), model)
    backbone_id = ensure_backbone(ledger, model.backbone, model.revision, weights)  # refuses other weights
    parent_v = parent.version or base_version(ledger, model.id)
    key = digest(["submitted", sha256_file(path), parent_v.id])  # the same delta on the same parent: one version
    run = find_training_run(ledger, backbone_id, skill, kind, 0, key, model_id=model.id)
    if run is not None and run_versions(ledger, run[0]):
        v = run_versions(ledger, run[0])[0]
        return Submitted(model.name, v.name, v.id, parent_v.name, kind, origin["sha256"], new=False)
    adapter, manifest = p.store.put_file(path), p.store.put_file(path.with_suffix(".json"))
    config = {"run_key": key, "submitted": origin | {"kind": kind, "layer": getattr(delta, "layer", None)}} | run_config
    atlas_id = _recorded_atlas(p, backbone_id, found, atlas, delta) if atlas is not None else None
    run_id = (
        run[0]
        if run
        else start_training_run(
            ledger,
            backbone_id,
            skill,
            kind,
            0,
            config,
            atlas_id=atlas_id,
            model_id=model.id,
            parent_version_id=parent_v.id,
        )
    )
    ckpt = record_checkpoint(ledger, run_id, 0, 0, adapter, {"manifest_sha256": manifest.sha256})
    if len(run_checkpoints(ledger, run_id)) == 1:
        log_checkpoint(ledger, p.bridge, ckpt.id)
    end_mlflow_run(ledger, p.bridge, run_id, "finished")
    v = register_version(ledger, ckpt.id, name=name)
    return Submitted(model.name, v.name, v.id, parent_v.name, kind, origin["sha256"], new=True)


def _recorded_atlas(p, backbone_id: int, found: _Found, atlas, delta) -> int:
    """The ledger id of a submitted residual's atlas: the one recorded with this file, or the file
    from the release folder stored and recorded now (content hash: its own sha256)."""
    from atlas_core.io import manifest_path
    from registry import find_atlas_file, record_atlas

    info = find_atlas_file(p.ledger, atlas.sha256)
    if info is not None:
        return info.id
    artifact, manifest = p.store.put_file(found.atlas_file), p.store.put_file(manifest_path(found.atlas_file))
    config = {"submitted": found.origin["source"], "manifest_sha256": manifest.sha256}
    return record_atlas(p.ledger, atlas.sha256, backbone_id, delta.config.layer, config, artifact).id
