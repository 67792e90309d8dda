"""Results fingerprinted per method: adding a method or a seed keeps every stored file valid, a
changed training config refuses that method's files only, a changed shared setting refuses the
experiment; the one-off migration from the old whole-config fingerprint (bench/repro/migrate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atlas_core.io import atomic_write_json
from atlas_core.paths import PROJECT_ROOT
from bench.repro.config import repro_from_dict
from bench.repro.migrate import legacy_fingerprint, migrate
from bench.repro.store import ResultStore, StaleResults

PLAIN = (PROJECT_ROOT / "configs/train/plain.yaml").read_text()


def _config(tmp_path: Path, **change):
    plain = tmp_path / "plain.yaml"  # a method whose training config a test edits
    if not plain.is_file():
        plain.write_text(PLAIN)
    return repro_from_dict(
        {
            "name": "t",
            "methods": {"atlas": "configs/train/atlas.yaml", "plain": str(plain)},
            "seeds": [0, 1],
            "lr_grid": [1e-3],
            "eval": {"kl_contexts": 8},
            **change,
        }
    )


def _records(store: ResultStore) -> dict[Path, dict]:
    """One file of every kind per method, and base.json."""
    out = {store.base_path(): {"kind": "base", "heldout_nll": 1.5}}
    for i, m in enumerate(("atlas", "plain")):
        out[store.sweep_path(m, 1e-3)] = {"kind": "sweep", "method": m, "best_val_loss": 0.9 + i}
        out[store.lr_path(m)] = {"kind": "lr", "method": m, "best_lr": 1e-3}
        out[store.unit_path(m, 0, 5)] = {"kind": "checkpoint", "method": m, "seed": 0, "kl": {"mean": 0.01 * (i + 1)}}
        out[store.run_path(m, 0)] = {"kind": "run", "method": m, "seed": 0, "steps": [5]}
    return out


@pytest.fixture
def stored(tmp_path):
    """A results folder of atlas and plain written under the first config."""
    config = _config(tmp_path)
    store = ResultStore.of(config, tmp_path / "results")
    store.check_experiment(config.to_dict())
    for path, record in _records(store).items():
        store.write(path, record)
    return tmp_path


def test_adding_a_method_and_a_seed_keeps_every_stored_result_valid(stored):
    config = _config(
        stored,
        seeds=[0, 1, 2],
        methods={
            "atlas": "configs/train/atlas.yaml",
            "plain": str(stored / "plain.yaml"),
            "weight-lora": "configs/train/weight-lora.yaml",
        },
    )
    store = ResultStore.of(config, stored / "results")
    store.check_experiment(config.to_dict())
    for path, record in _records(store).items():
        assert store.read(path) == {"schema": 1, "fingerprint": store.expected(path), **record}
    experiment = json.loads((stored / "results" / "experiment.json").read_text())
    assert experiment["config"] == config.to_dict()  # the added method and seed are recorded
    assert experiment["method_fingerprints"] == config.method_fingerprints()
    assert sorted(experiment["method_fingerprints"]) == ["atlas", "plain", "weight-lora"]


def test_a_changed_training_config_refuses_that_method_only(stored):
    plain = stored / "plain.yaml"
    plain.write_text(PLAIN.replace("lr: 2.0e-4", "lr: 5.0e-3"))  # set per run by the experiment: no change
    config = _config(stored)
    ResultStore.of(config, stored / "results").check_experiment(config.to_dict())
    plain.write_text(PLAIN.replace("batch_size: 8", "batch_size: 4"))  # this one changes what plain computes
    config = _config(stored)
    store = ResultStore.of(config, stored / "results")
    before = (stored / "results" / "experiment.json").read_text()
    with pytest.raises(StaleResults, match=r"lr/plain\.json: method 'plain': its training config \(.*plain\.yaml\)"):
        store.check_experiment(config.to_dict())
    assert (stored / "results" / "experiment.json").read_text() == before
    for path, record in _records(store).items():
        if store.method_of(path) == "plain":
            with pytest.raises(StaleResults, match=f"{path}: written by another training config of method 'plain'"):
                store.read(path)
        else:
            assert store.read(path)["kind"] == record["kind"]  # atlas and base stay valid


def test_a_changed_shared_setting_is_refused_naming_the_field(stored):
    results = stored / "results"
    before = (results / "experiment.json").read_text()
    for change, message in [
        ({"eval": {"kl_contexts": 16}}, "fields differing: eval.kl_contexts"),
        ({"epochs": 3}, "fields differing: epochs"),
        ({"seeds": [1, 0]}, "seeds: the stored sweeps were run at seed 0"),
    ]:
        config = _config(stored, **change)
        store = ResultStore.of(config, results)
        with pytest.raises(StaleResults, match=message):
            store.check_experiment(config.to_dict())
        if "seeds" not in change:
            with pytest.raises(StaleResults, match="another experiment configuration"):
                store.read(store.base_path())
            with pytest.raises(StaleResults, match="method 'atlas'"):
                store.read(store.unit_path("atlas", 0, 5))
    assert (results / "experiment.json").read_text() == before


def _old_folder(tmp_path: Path) -> tuple[Path, dict]:
    """A results folder as the code before per-method fingerprints wrote it."""
    config = _config(tmp_path).to_dict()
    old = legacy_fingerprint(config)
    root = tmp_path / "old"
    for path, record in _records(ResultStore(root, "", {"atlas": "", "plain": ""})).items():
        atomic_write_json(path, {"schema": 1, "fingerprint": old, **record})
    atomic_write_json(
        root / "experiment.json", {"schema": 1, "fingerprint": old, "config": config, "atlas_sha256": "a" * 64}
    )
    return root, config


def test_migration_rewrites_only_the_fingerprints(tmp_path):
    root, config = _old_folder(tmp_path)
    before = {p: json.loads(p.read_text()) for p in root.rglob("*.json")}
    store = ResultStore.of(_config(tmp_path), root)
    with pytest.raises(StaleResults, match="old whole-config fingerprints: run python -m bench.repro.migrate"):
        store.check_experiment(config)
    assert migrate(root) == len(before) - 1
    store.check_experiment(config)
    for path, record in before.items():
        migrated = store.read(path)
        assert migrated["fingerprint"] == store.expected(path) != record["fingerprint"]
        assert {k: v for k, v in migrated.items() if k not in ("fingerprint", "method_fingerprints")} == {
            k: v for k, v in record.items() if k != "fingerprint"
        }
    assert migrate(root) == 0  # a second run finds nothing to do


def test_migration_refuses_a_file_without_the_old_fingerprint(tmp_path):
    root, _ = _old_folder(tmp_path)
    unit = root / "units" / "plain" / "seed0-step000005.json"
    atomic_write_json(unit, {**json.loads(unit.read_text()), "fingerprint": "0" * 64})
    before = {p: p.read_text() for p in root.rglob("*.json")}
    with pytest.raises(StaleResults, match=f"{unit}: fingerprint 000000000000 is neither"):
        migrate(root)
    assert {p: p.read_text() for p in root.rglob("*.json")} == before  # nothing written
    (tmp_path / "plain.yaml").write_text(PLAIN.replace("batch_size: 8", "batch_size: 4"))
    with pytest.raises(StaleResults, match="experiment.json: fingerprint .* is not the old whole-config"):
        migrate(root)  # a method config changed since the results were written


@pytest.mark.parametrize("name", ["smollm2", "smoke"])
def test_committed_results_are_valid_for_the_committed_configs(name, tmp_path):
    """The migrated results carry the fingerprints the experiment files give (a copy is checked:
    check_experiment records methods added to the config)."""
    import shutil

    from bench.repro.config import load_repro_config

    config = load_repro_config(PROJECT_ROOT / "configs" / "repro" / f"{name}.yaml")
    shutil.copytree(PROJECT_ROOT / "results" / "repro" / config.name, tmp_path / "results")
    store = ResultStore.of(config, tmp_path / "results")
    store.check_experiment(config.to_dict())
    files = [p for p in (tmp_path / "results").rglob("*.json") if p.name != "experiment.json"]
    assert files and all(store.read(p) is not None for p in files)


def test_choosing_rates_by_the_own_objective_is_a_shared_setting(tmp_path):
    """lr_select: 'ce' (the default) leaves the fingerprint of an experiment written before the field;
    'objective' picks other rates, so it is another experiment; anything else is refused by name."""
    from atlas_core.typed_config import ConfigError
    from bench.repro.config import experiment_fingerprint

    ce = _config(tmp_path)
    assert "lr_select" not in ce.to_dict() and _config(tmp_path, lr_select="ce").fingerprint() == ce.fingerprint()
    assert experiment_fingerprint(ce.to_dict()) == ce.fingerprint()  # a stored config without the field
    own = _config(tmp_path, lr_select="objective")
    assert own.to_dict()["lr_select"] == "objective" and own.fingerprint() != ce.fingerprint()
    with pytest.raises(ConfigError, match=r"lr_select: expected one of \['ce', 'objective'\], got 'loss'"):
        _config(tmp_path, lr_select="loss")
