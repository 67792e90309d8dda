"""A fuzz of bad inputs at every boundary a user touches: each is refused with an error that names
the file and the field (or line), and nothing is left half-written.

Boundaries: update configs and release policies (YAML), skill and retained-domain files (JSONL),
stored tensor files and their manifests (truncated, altered, mismatched), and a hash the
store does not hold (a ledger row whose artifact is gone).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from atlas_core.typed_config import ConfigError
from flows.config import load_update_config
from flows.policy import load_policy
from tests.conftest_registry import ledger, ledger_url, store  # noqa: F401
from tests.flows_fixtures import PASSING_POLICY, TINY_CONFIG, write_yaml

WRONG = ["many", -3, 0, 1.5, [], {"x": 1}, None, True]


def leaves(tree: dict, prefix: str = ""):
    """(dotted path, value) of every scalar leaf of a nested mapping."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{path}.")
        elif not isinstance(value, list):
            yield path, value


def with_value(tree: dict, path: str, value) -> dict:
    out = json.loads(json.dumps(tree))
    *parents, last = path.split(".")
    node = out
    for p in parents:
        node = node[p]
    node[last] = value
    return out


def _accepted(loader, data: dict, path: Path) -> bool:
    try:
        loader(write_yaml(path, data))
        return True
    except ConfigError:
        return False


@pytest.mark.parametrize("which", ["config", "policy"])
def test_every_field_of_a_config_or_policy_rejects_a_wrong_value_by_name(which, tmp_path):
    base = TINY_CONFIG if which == "config" else PASSING_POLICY
    loader = load_update_config if which == "config" else (lambda p: load_policy(p, ["gsm8k", "csqa"]))
    rng, refused = random.Random(0), 0
    for path, good in leaves(base):
        for wrong in rng.sample(WRONG, 4):
            if type(wrong) is type(good) or (isinstance(good, float) and type(wrong) is int):
                continue  # may be a valid value of the right type (range checks are tested per field)
            file = tmp_path / f"{path}.yaml"
            try:
                loader(write_yaml(file, with_value(base, path, wrong)))
            except ConfigError as e:
                refused += 1
                assert path.split(".")[-1] in str(e) and str(file) in str(e), (path, wrong, str(e))
            # A value of another type that is still meaningful (e.g. null for an optional limit) may load.
    assert refused >= 20
    for typo in ("retaned", "candidatez"):
        with pytest.raises(ConfigError, match=typo):
            loader(write_yaml(tmp_path / "typo.yaml", base | {typo: 1}))


def test_a_config_or_policy_that_is_not_yaml_or_not_a_mapping_is_named(tmp_path):
    for text in ("backbone: [unclosed", "- a\n- list", "\x00\x01"):  # (an empty file means the defaults)
        path = tmp_path / "broken.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match="broken.yaml"):
            load_update_config(path)
        with pytest.raises(ConfigError, match="broken.yaml") as e:
            load_policy(path)
        assert str(e.value).count("broken.yaml") == 1


@pytest.mark.parametrize("loader_name", ["load_skill_jsonl", "load_domain_jsonl"])
def test_every_broken_jsonl_line_is_named_by_file_and_line(loader_name, tmp_path):
    from evaluation import userdata

    loader = getattr(userdata, loader_name)
    good = ({"id": "a", "prompt": "p", "response": "r"} if loader_name == "load_skill_jsonl"
            else {"id": "a", "prompt": "p", "reference": "r"})
    broken = ['{"id": "b", "prompt": ', "[1, 2]", json.dumps({k: v for k, v in good.items() if k != "prompt"}),
              json.dumps(good | {"prompt": 7}), json.dumps(good)]  # the last: a duplicate id
    for line in broken:
        path = tmp_path / "set.jsonl"
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=r"set\.jsonl.*line 2"):
            loader(path)


def test_stored_tensor_files_refuse_truncation_alteration_and_a_foreign_manifest(tmp_path):
    from atlas_core.io import IntegrityError, load_verified, save_verified

    path = tmp_path / "adapter.safetensors"
    save_verified(path, {"B": torch.randn(8, 4)}, {"kind": "adapter"})
    original, manifest = path.read_bytes(), path.with_suffix(".json").read_text()
    cases = {"truncated": original[: len(original) // 2], "flipped": original[:-1] + bytes([original[-1] ^ 1]),
             "empty": b""}
    for name, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(IntegrityError, match="adapter.safetensors"):
            load_verified(path)
    path.write_bytes(original)
    for name, text in {"not json": manifest[:-5], "other sha": manifest.replace('"sha256": "', '"sha256": "0'),
                       "no sha": json.dumps({k: v for k, v in json.loads(manifest).items() if k != "sha256"})}.items():
        path.with_suffix(".json").write_text(text)
        with pytest.raises(IntegrityError, match="adapter"):
            load_verified(path)
    path.with_suffix(".json").unlink()
    with pytest.raises(IntegrityError, match="adapter"):
        load_verified(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter.safetensors"]  # nothing else was written


def test_the_artifact_store_refuses_a_stored_file_altered_behind_its_back(tmp_path):
    from registry import ArtifactError, ArtifactStore

    store = ArtifactStore(tmp_path / "store")
    source = tmp_path / "atlas.safetensors"
    source.write_bytes(b"weights" * 100)
    info = store.put_file(source)
    stored = next(p for p in (tmp_path / "store").rglob("*") if p.is_file() and p.read_bytes() == source.read_bytes())
    stored.write_bytes(b"weights" * 99)
    with pytest.raises(ArtifactError, match=info.sha256[:12]):
        store.fetch(info.sha256, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()  # no half-fetched copy left behind


def test_a_sha256_the_store_does_not_hold_is_a_clear_error(tmp_path):
    """What a ledger row pointing at a lost artifact meets: an error naming the hash, no partial file."""
    from registry import ArtifactError, ArtifactStore

    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(ArtifactError, match="ab" * 32):
        store.fetch("ab" * 32, tmp_path / "adapter.safetensors")
    assert not (tmp_path / "adapter.safetensors").exists()


def test_a_policy_file_with_a_bad_threshold_names_the_domain(tmp_path):
    policy = PASSING_POLICY | {"max_kl_vs_champion": {"gsm8k": "low", "csqa": 0.1}}
    with pytest.raises(ConfigError, match=r"max_kl_vs_champion.*gsm8k"):
        load_policy(write_yaml(tmp_path / "p.yaml", policy), ["gsm8k", "csqa"])
    with pytest.raises(ConfigError, match=r"csqa"):  # a watched domain without a threshold
        load_policy(write_yaml(tmp_path / "q.yaml", PASSING_POLICY | {"max_kl_vs_base": {"gsm8k": 0.1}}),
                    ["gsm8k", "csqa"])
    assert yaml.safe_load(Path(tmp_path / "p.yaml").read_text())["max_kl_vs_champion"]["gsm8k"] == "low"


def test_a_ledger_version_whose_adapter_manifest_was_never_recorded_is_named(ledger, ledger_url, store, tmp_path,
                                                                              monkeypatch):
    """A corrupted ledger row reference: the version's checkpoint carries no manifest hash."""
    from flows import runtime
    from registry import LedgerError
    from tests.conftest_registry import make_candidates, unique_backbone

    monkeypatch.setenv("ATLAS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ATLAS_LEDGER_URL", ledger_url)
    monkeypatch.setenv("ATLAS_ARTIFACT_STORE", str(store.root_url))
    _, (version,) = make_candidates(ledger, store, unique_backbone(), seeds=(0,))
    with runtime.session(), pytest.raises(LedgerError, match=rf"{version.name} \(id {version.id}\).*manifest"):
        runtime.delta(version)
    assert not (tmp_path / "state" / "cache").exists()  # nothing fetched
