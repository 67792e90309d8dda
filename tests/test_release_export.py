"""Release folders: loading a chain of two deltas as a ready model, rejecting any flipped byte,
and exporting it for PEFT (one adapter) and plain transformers (merged weights), each equal to
the platform's own adapted model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from atlas_core.backbone import weights_sha256
from atlas_core.chain import Chain, load_delta
from atlas_core.export import export_folder, export_merged, export_peft
from atlas_core.io import IntegrityError
from atlas_core.release import load_folder, write_manifest
from atlas_core.residual import save_adapter
from evaluation.tiny import load_model
from tests.test_chain import saved_atlas, trained_lora, trained_residual

TINY = "tiny-llama"


def _ids() -> torch.Tensor:
    return torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def write_release(tmp_path: Path, kinds: tuple[str, ...]) -> Path:
    """A release folder (atlas_core.release layout) whose chain has one delta per entry of `kinds`:
    'lora' on o_proj of layers 1 and 2 in turn, or 'atlas' (a full ATLAS residual at layer 2)."""
    bb = load_model(TINY, "float32")
    folder = tmp_path / "release"
    atlas = saved_atlas(tmp_path) if "atlas" in kinds else None
    chain = []
    for i, kind in enumerate(kinds, start=1):
        stem = f"deltas/{i:02d}-v{i}"
        path = folder / f"{stem}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "lora":
            lora = trained_lora(bb.model, seed=i, layer=1 + (i % 2))
            manifest = lora.save(path, {})
            lora.remove()
        else:
            manifest = save_adapter(path, trained_residual(bb.model, seed=i, variant="atlas", atlas=atlas))
        entry = {
            "name": f"v{i}",
            "method": kind,
            "adapter": f"{stem}.safetensors",
            "adapter_sha256": manifest["sha256"],
            "atlas": None,
            "atlas_sha256": None,
        }
        if kind == "atlas":
            (folder / "atlases").mkdir(exist_ok=True)
            for suffix in (".safetensors", ".json"):
                shutil.copy(tmp_path / f"atlas{suffix}", folder / "atlases" / f"{atlas.sha256[:16]}{suffix}")
            entry |= {"atlas": f"atlases/{atlas.sha256[:16]}.safetensors", "atlas_sha256": atlas.sha256}
        chain.append(entry)
    backbone = {"name": TINY, "revision": bb.revision, "weights_sha256": weights_sha256(bb.model)}
    write_manifest(
        folder, {"format": 2, "name": f"v{len(kinds)}", "model": f"{TINY}.test", "chain": chain, "backbone": backbone}
    )  # with its manifest.sha256, as every writer does
    return folder


@torch.no_grad()
def platform_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """The platform's own adapted model: a fresh backbone with the chain attached by atlas_core.chain."""
    bb = load_model(TINY, "float32")
    manifest = json.loads((folder / "manifest.json").read_text())
    atlases = {d["atlas_sha256"]: folder / d["atlas"] for d in manifest["chain"] if d["atlas"]}
    from atlas_core.atlas import Atlas

    deltas = [load_delta(folder / d["adapter"], lambda sha: Atlas.load(atlases[sha])) for d in manifest["chain"]]
    with Chain(deltas).attached(bb.model):
        return bb.model(ids).logits


@pytest.mark.parametrize("kinds", [("lora", "lora"), ("atlas", "atlas"), ("atlas", "lora")])
def test_a_loaded_release_is_the_platforms_adapted_model(tmp_path, kinds):
    folder, ids = write_release(tmp_path, kinds), _ids()
    release = load_folder(folder, dtype="float32", backbone_loader=load_model)
    with torch.no_grad():
        got = release.model(ids).logits
        torch.testing.assert_close(got, platform_logits(folder, ids), rtol=0, atol=0)
        release.detach()
        base = release.model(ids).logits
    assert (got - base).abs().max() > 1e-3  # the chain is attached, and detach takes it off
    assert all(not m._forward_hooks for m in release.model.modules())


def test_the_chain_stays_attached_as_long_as_the_model_lives(tmp_path):
    import gc

    folder, ids = write_release(tmp_path, ("atlas", "lora")), _ids()
    model = load_folder(folder, dtype="float32", backbone_loader=load_model).model  # the release object is dropped
    gc.collect()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, platform_logits(folder, ids), rtol=0, atol=0)


@pytest.mark.parametrize("target", ["delta", "delta-manifest", "atlas", "atlas-manifest"])
def test_a_flipped_byte_anywhere_in_the_chain_is_rejected_with_file_and_hash(tmp_path, target):
    folder = write_release(tmp_path, ("atlas", "lora"))
    manifest = json.loads((folder / "manifest.json").read_text())
    relative = manifest["chain"][0]["atlas" if target.startswith("atlas") else "adapter"]
    path = folder / relative
    if target.endswith("manifest"):  # a manifest edited to match a swapped file: the release's own hash refuses it
        path = path.with_suffix(".json")
        data = json.loads(path.read_text())
        data["sha256"] = "0" * 64
        path.write_text(json.dumps(data))
    else:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as e:
        load_folder(folder, dtype="float32", backbone_loader=load_model)
    expected = manifest["chain"][0]["atlas_sha256" if target.startswith("atlas") else "adapter_sha256"]
    assert relative.rsplit("/", 1)[-1].split(".")[0] in str(e.value) and expected in str(e.value)


def test_other_backbone_weights_are_refused(tmp_path):
    folder = write_release(tmp_path, ("lora",))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["backbone"]["weights_sha256"] = "1" * 64
    write_manifest(folder, manifest)  # a release written for other weights (its sidecar matches)
    with pytest.raises(IntegrityError, match="weights do not match"):
        load_folder(folder, dtype="float32", backbone_loader=load_model)


def test_two_lora_deltas_export_as_one_peft_adapter_with_the_same_logits(tmp_path):
    from peft import PeftModel

    folder, ids = write_release(tmp_path, ("lora", "lora", "lora")), _ids()  # two deltas share layer 2's o_proj
    release = load_folder(folder, dtype="float32", backbone_loader=load_model)
    out = export_peft(release, tmp_path / "peft")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and sorted(config["rank_pattern"].values()) == [4, 8]
    peft_model = PeftModel.from_pretrained(load_model(TINY, "float32").model, str(out))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, platform_logits(folder, ids), rtol=1e-5, atol=1e-5)


def test_an_atlas_chain_exports_as_one_peft_adapter_that_peft_saves_and_loads_like_a_lora(tmp_path):
    from peft import PeftModel

    import atlas_core  # noqa: F401 (registers the ATLAS PEFT method)

    folder, ids = write_release(tmp_path, ("atlas", "atlas")), _ids()  # two residuals on layer 2, in chain order
    release = load_folder(folder, dtype="float32", backbone_loader=load_model)
    out = export_peft(release, tmp_path / "peft")
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "ATLAS"
    want = platform_logits(folder, ids)
    peft_model = PeftModel.from_pretrained(load_model(TINY, "float32").model, str(out))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, want, rtol=1e-5, atol=1e-5)
        peft_model.save_pretrained(tmp_path / "again")  # PEFT's own save of the loaded adapter
        again = PeftModel.from_pretrained(load_model(TINY, "float32").model, str(tmp_path / "again"))
        torch.testing.assert_close(again(ids).logits, want, rtol=1e-5, atol=1e-5)
        with again.disable_adapter():
            torch.testing.assert_close(again(ids).logits, load_model(TINY, "float32").model(ids).logits, rtol=0, atol=0)


def test_a_lora_chain_exports_merged_weights_that_plain_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    folder, ids = write_release(tmp_path, ("lora", "lora")), _ids()
    release = load_folder(folder, dtype="float32", backbone_loader=load_model)
    out = export_merged(release, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, platform_logits(folder, ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(release.model(ids).logits, platform_logits(folder, ids), rtol=0, atol=0)


def test_a_residual_does_not_merge_and_a_mixed_chain_is_no_single_peft_adapter(tmp_path):
    release = load_folder(write_release(tmp_path, ("atlas", "lora")), dtype="float32", backbone_loader=load_model)
    with pytest.raises(ValueError, match="input-conditioned"):
        export_merged(release, tmp_path / "merged")
    with pytest.raises(ValueError, match="mixes ATLAS residuals and LoRA"):
        export_peft(release, tmp_path / "peft")


def test_a_bundled_folder_loads_without_the_backbone_loader(tmp_path):
    folder, ids = write_release(tmp_path, ("atlas", "lora")), _ids()
    release = load_folder(folder, dtype="float32", backbone_loader=load_model)
    out = export_folder(release, folder, tmp_path / "bundled", bundle_backbone=True)

    def no_loader(name, dtype):
        raise AssertionError("the bundled backbone should be used")

    again = load_folder(out, dtype="float32", backbone_loader=no_loader)
    with torch.no_grad():
        torch.testing.assert_close(again.model(ids).logits, platform_logits(folder, ids), rtol=0, atol=0)


def test_an_export_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    import safetensors.torch

    release = load_folder(write_release(tmp_path, ("lora",)), dtype="float32", backbone_loader=load_model)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(ValueError, match="not an empty folder"):
        export_peft(release, tmp_path / "taken")
    assert (tmp_path / "taken" / "x").read_text() == "mine"

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        export_peft(release, tmp_path / "exports" / "peft")
    assert list((tmp_path / "exports").iterdir()) == []  # neither the folder nor a half-written temp
