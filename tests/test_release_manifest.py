"""A release verifies all of itself: an edited manifest.json (a delta dropped from the chain, two
deltas swapped, another backbone) is refused on every load path, with the file and the sha256 it
was expected to have: the ledger's cached folder (against the ledger's record and chain), a
`models:/` download (against the version's `manifest_sha256` tag), a bare exported folder and
the MLflow pyfunc model (against the folder's manifest.sha256 sidecar).

The line is built by hand in a fresh state folder, no update cycle: the two deltas of
tests/test_release_export.write_release (an ATLAS residual, then a LoRA on top) are stored and
recorded as versions v1 and v2 (v2's chain: both), and v2 is published to MLflow as a pyfunc.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

from atlas_core.io import IntegrityError, sha256_file
from atlas_core.release import MANIFEST, SIDECAR, load_folder, write_manifest
from evaluation.tiny import load_model
from tests.flows_fixtures import use_state
from tests.test_release_export import write_release

MODEL = "tiny-llama.manifest"


def _drop_first(m: dict) -> None:
    m["chain"].pop(0)


def _reorder(m: dict) -> None:
    m["chain"][0], m["chain"][1] = m["chain"][1], m["chain"][0]


def _revision(m: dict) -> None:
    m["backbone"]["revision"] = "another-revision"


def _name(m: dict) -> None:
    m["backbone"]["name"] = "another/backbone"


EDITS: dict[str, Callable[[dict], None]] = {
    "drop-first-delta": _drop_first,
    "reorder-deltas": _reorder,
    "backbone-revision": _revision,
    "backbone-name": _name,
}


@pytest.fixture(scope="module")
def line(tmp_path_factory) -> Iterator[dict]:
    """A state folder whose line `manifest` has v1 (ATLAS residual) and v2 (v1 + a LoRA), v2 published."""
    import registry as r
    from flows.platform import open_platform
    from flows.pyfunc import pyfunc_model

    tmp = tmp_path_factory.mktemp("manifest")
    source = write_release(tmp, ("atlas", "lora"))
    made = json.loads((source / MANIFEST).read_text())
    with pytest.MonkeyPatch.context() as mp:
        use_state(mp, tmp / "state")
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):  # open_platform sets them: undone after
            mp.setenv(name, "")
        p = open_platform()
        try:
            ledger, store = p.ledger, p.store
            bb = made["backbone"]
            backbone_id = r.ensure_backbone(ledger, bb["name"], bb["revision"], bb["weights_sha256"])
            model = r.ensure_model(ledger, backbone_id, "manifest")

            def stored(relative: str) -> tuple[r.StoredArtifact, str]:
                path = source / relative
                return store.put_file(path), store.put_file(path.with_suffix(".json")).sha256

            atlas_file, atlas_manifest = stored(made["chain"][0]["atlas"])
            atlas = r.record_atlas(
                ledger,
                made["chain"][0]["atlas_sha256"],
                backbone_id,
                2,
                {"manifest_sha256": atlas_manifest},
                atlas_file,
            )
            versions, parent = [], None
            for entry, method in zip(made["chain"], ("atlas", "weight-lora")):
                run = r.start_training_run(
                    ledger,
                    backbone_id,
                    entry["name"],
                    method,
                    0,
                    {},
                    atlas_id=atlas.id if method == "atlas" else None,
                    model_id=model.id,
                    parent_version_id=parent,
                )
                adapter, adapter_manifest = stored(entry["adapter"])
                ckpt = r.record_checkpoint(ledger, run, 1, 1, adapter, {"manifest_sha256": adapter_manifest})
                parent = r.register_version(ledger, ckpt.id).id
                versions.append(r.get_version(ledger, parent))
            number = r.publish_version(ledger, store, p.bridge, parent, pyfunc_model())
        finally:
            p.close()
        yield {"state": tmp / "state", "v1": versions[0].name, "v2": versions[1].name, "number": number}


@contextmanager
def edited(folder: Path, edit: Callable[[dict], None], sidecar: bool) -> Iterator[str]:
    """The folder's manifest.json edited for the block (with a matching sidecar when `sidecar`:
    what someone who knows the format would do), both restored after it; yields the sha256 the
    folder had before, the one a refusal must name."""
    saved = {name: (folder / name).read_bytes() if (folder / name).exists() else None for name in (MANIFEST, SIDECAR)}
    before = sha256_file(folder / MANIFEST)
    manifest = json.loads(saved[MANIFEST])
    edit(manifest)
    try:
        if sidecar:
            write_manifest(folder, manifest)
        else:
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        yield before
    finally:
        for name, data in saved.items():
            if data is None:
                (folder / name).unlink(missing_ok=True)
            else:
                (folder / name).write_bytes(data)


def _refused(load: Callable[[], object], *names: str) -> None:
    with pytest.raises(IntegrityError) as e:
        load()
    for name in names:
        assert name in str(e.value), (name, str(e.value))


def _cache(line: dict) -> Path:
    from flows import load_release

    load_release(MODEL, line["v2"], dtype="float32")  # writes the cache folder, if not there yet
    return (
        line["state"]
        / "cache"
        / "releases"
        / MODEL
        / next(
            p.name for p in (line["state"] / "cache" / "releases" / MODEL).iterdir() if p.name.startswith(line["v2"])
        )
    )


def _published(line: dict) -> Path:
    """v2's release folder as MLflow stores it (the pyfunc model's artifacts/release)."""
    return next(
        p.parent
        for p in (line["state"] / "mlflow" / "artifacts").rglob(MANIFEST)
        if f"versions/{line['v2']}/artifacts/release" in p.as_posix()
    )


def test_unedited_folders_load_on_every_path_and_carry_the_recorded_sha256(line):
    import registry as r
    from flows import load_release
    from flows.platform import open_platform

    release = load_release(MODEL, line["v2"], dtype="float32")
    assert [d["name"] for d in release.manifest["chain"]] == [line["v1"], line["v2"]] and len(release.chain) == 2
    cache, published = _cache(line), _published(line)
    p = open_platform()
    try:
        v = r.resolve_version(p.ledger, MODEL, line["v2"])
        recorded = r.recorded_manifest_sha256(p.ledger, v.id)
        tag = p.bridge.version_tags(MODEL, line["number"])[r.MANIFEST_TAG]
    finally:
        p.close()
    assert recorded == tag == sha256_file(cache / MANIFEST) == sha256_file(published / MANIFEST)
    assert (cache / SIDECAR).read_text() == f"{recorded}  {MANIFEST}\n"  # `sha256sum -c manifest.sha256` format
    assert len(load_release(f"models:/{MODEL}/{line['number']}", dtype="float32").chain) == 2


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_ledger_cache_is_refused_and_not_rewritten(line, edit):
    from flows import load_release

    folder = _cache(line)
    with edited(folder, EDITS[edit], sidecar=True) as expected:  # the sidecar matches: the ledger refuses it
        changed = (folder / MANIFEST).read_bytes()
        _refused(lambda: load_release(MODEL, line["v2"], dtype="float32"), str(folder / MANIFEST), expected)
        assert (folder / MANIFEST).read_bytes() == changed  # left for a person to look at, not rewritten


def test_a_folder_cached_before_the_ledger_recorded_manifests_is_checked_against_the_ledger(line):
    """An older cache: no sidecar, no sha256 in the ledger. The ledger's rows give the manifest's
    bytes again, so the folder is checked against those (and the sha256 recorded) before it is used."""
    import registry as r
    from flows import load_release
    from flows.platform import open_platform
    from registry.models import ModelVersion

    folder = _cache(line)

    def forget() -> str:
        p = open_platform()
        try:
            v = r.resolve_version(p.ledger, MODEL, line["v2"])
            with p.ledger.transaction() as s:
                s.get(ModelVersion, v.id).manifest_sha256 = None
        finally:
            p.close()
        (folder / SIDECAR).unlink(missing_ok=True)
        return sha256_file(folder / MANIFEST)

    recorded = forget()
    with edited(folder, _reorder, sidecar=False):
        _refused(lambda: load_release(MODEL, line["v2"], dtype="float32"), str(folder / MANIFEST), recorded)
    forget()
    assert len(load_release(MODEL, line["v2"], dtype="float32").chain) == 2
    assert (folder / SIDECAR).read_text() == f"{recorded}  {MANIFEST}\n"  # recorded again, and the sidecar added


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_mlflow_model_version_is_refused(line, edit):
    from flows import load_release

    with edited(_published(line), EDITS[edit], sidecar=True) as expected:  # the version's tag refuses it
        _refused(lambda: load_release(f"models:/{MODEL}/{line['number']}", dtype="float32"), MANIFEST, expected)


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_exported_folder_is_refused(line, tmp_path, edit):
    from atlas_core.export import export_folder
    from flows import load_release

    cache = _cache(line)
    out = export_folder(load_folder(cache, dtype="float32", backbone_loader=load_model), cache, tmp_path / "export")
    assert sha256_file(out / MANIFEST) == sha256_file(cache / MANIFEST)  # the same release, the same bytes
    with edited(out, EDITS[edit], sidecar=False) as expected:
        _refused(lambda: load_release(str(out), dtype="float32"), str(out / MANIFEST), expected)


def test_an_edited_pyfunc_model_is_refused(line):
    import mlflow.pyfunc

    with edited(_published(line), _drop_first, sidecar=False) as expected:
        _refused(lambda: mlflow.pyfunc.load_model(f"models:/{MODEL}/{line['number']}"), MANIFEST, expected)


def test_a_folder_without_sidecar_or_backbone_weights_is_refused_unless_the_caller_opts_out(line, tmp_path):
    folder = tmp_path / "legacy"
    shutil.copytree(_cache(line), folder)
    (folder / SIDECAR).unlink()  # as written before sidecars existed
    _refused(lambda: load_folder(folder, dtype="float32", backbone_loader=load_model), SIDECAR, "export it again")
    assert len(load_folder(folder, dtype="float32", backbone_loader=load_model, require_sidecar=False).chain) == 2

    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["backbone"]["weights_sha256"]
    write_manifest(folder, manifest)
    _refused(
        lambda: load_folder(folder, dtype="float32", backbone_loader=load_model),
        str(folder / MANIFEST),
        "weights_sha256",
        "verify_backbone=False",
    )
    assert len(load_folder(folder, dtype="float32", backbone_loader=load_model, verify_backbone=False).chain) == 2


@pytest.mark.parametrize("crash_at", [SIDECAR, MANIFEST])
def test_a_crash_while_a_manifest_is_rewritten_leaves_no_folder_that_verifies(line, tmp_path, monkeypatch, crash_at):
    import atlas_core.release as release

    folder = tmp_path / "half"
    shutil.copytree(_cache(line), folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["name"] = "renamed"
    real = release.atomic_write_bytes

    def crash(path, data):
        if Path(path).name == crash_at:
            raise OSError("killed")
        real(path, data)

    monkeypatch.setattr(release, "atomic_write_bytes", crash)
    with pytest.raises(OSError, match="killed"):
        write_manifest(folder, manifest)  # one of the pair new, the other old
    monkeypatch.setattr(release, "atomic_write_bytes", real)
    if crash_at == SIDECAR:  # nothing written yet: the old pair, still whole
        assert len(load_folder(folder, dtype="float32", backbone_loader=load_model).chain) == 2
    else:
        _refused(lambda: load_folder(folder, dtype="float32", backbone_loader=load_model), str(folder / MANIFEST))
