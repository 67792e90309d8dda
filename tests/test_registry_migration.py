"""Migration 0002 (lines and version chains) on a ledger that was written with schema 0001;
migration 0004 (the release manifest's sha256) on one written with schema 0003."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import sqlalchemy as sa
from sqlalchemy import inspect
from sqlalchemy.exc import IntegrityError

import registry as r
from registry.db import VERSION_TABLE, make_engine
from registry.lines import record_manifest_sha256
from registry.models import ModelVersion

NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)
SHA = "0" * 64
NAME = "tiny-code-atlas-s0-e1"


def write_0001_ledger(engine) -> None:
    """Two models of schema 0001: `code` with a base version and versions that share a name
    (the third already holds `-r2`), and `csqa` without a base version; one run of a skill
    that has no model."""
    tables = sa.MetaData()
    tables.reflect(engine)
    t = tables.tables
    with engine.begin() as conn:
        ins = lambda name, *rows: conn.execute(t[name].insert(), list(rows))
        ins("ledger_backbones", dict(id=1, name="org/tiny", revision="rev-1", created_at=NOW))
        ins(
            "ledger_registered_models",
            dict(id=1, name="org--tiny.code", backbone_id=1, skill="code", created_at=NOW),
            dict(id=2, name="org--tiny.csqa", backbone_id=1, skill="csqa", created_at=NOW),
        )
        run = dict(backbone_id=1, method="atlas", seed=0, config={}, status="finished", started_at=NOW)
        ins(
            "ledger_training_runs",
            dict(run, id=1, skill="code"),
            dict(run, id=2, skill="code"),
            dict(run, id=3, skill="csqa"),
            dict(run, id=4, skill="gsm8k"),
        )
        ckpt = dict(epoch=1, step=10, adapter_sha256=SHA, adapter_uri="file:///a", metrics={}, created_at=NOW)
        ins(
            "ledger_checkpoints",
            *(dict(ckpt, id=i, training_run_id=i) for i in (1, 2, 3)),
            dict(ckpt, id=4, training_run_id=2, step=20),
        )
        version = dict(registered_model_id=1, created_at=NOW)
        ins(
            "ledger_model_versions",
            dict(version, id=1, checkpoint_id=None, name="tiny-base"),
            dict(version, id=2, checkpoint_id=1, name=NAME),
            dict(version, id=3, checkpoint_id=2, name=NAME),
            dict(version, id=4, checkpoint_id=4, name=f"{NAME}-r2"),
            dict(version, id=5, checkpoint_id=3, name=NAME, registered_model_id=2),
        )


def rows(engine, sql: str) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(sa.text(sql))]


def test_upgrade_from_0001_backfills_lines_parents_and_names(ledger_url):
    engine = make_engine(ledger_url)
    try:
        r.upgrade(ledger_url, "0001")
        write_0001_ledger(engine)
        r.upgrade(ledger_url)

        assert rows(engine, "SELECT id, name, line FROM ledger_registered_models ORDER BY id") == [
            (1, "org--tiny.code", "code"),
            (2, "org--tiny.csqa", "csqa"),
        ]
        # Non-base versions sit on their model's base version (none in csqa); the second
        # holder of NAME takes the first free suffix: -r2 is taken, so -r3.
        assert rows(engine, "SELECT id, parent_version_id, name, status FROM ledger_model_versions ORDER BY id") == [
            (1, None, "tiny-base", "active"),
            (2, 1, NAME, "active"),
            (3, 1, f"{NAME}-r3", "active"),
            (4, 1, f"{NAME}-r2", "active"),
            (5, None, NAME, "active"),
        ]
        assert rows(
            engine, "SELECT id, registered_model_id, parent_version_id FROM ledger_training_runs ORDER BY id"
        ) == [(1, 1, 1), (2, 1, 1), (3, 2, None), (4, None, None)]

        with r.Ledger(ledger_url) as ledger:  # the migrated ledger works through the API
            assert r.resolve_version(ledger, "org--tiny.code", f"{NAME}-r3").id == 3
            assert [v.id for v in r.version_chain(ledger, 3)] == [3]
            assert r.get_model(ledger, 1).line == "code"

        r.downgrade(ledger_url, "0001")
        columns = {c["name"] for c in inspect(engine).get_columns("ledger_registered_models")}
        assert "skill" in columns and "line" not in columns
        assert "parent_version_id" not in {c["name"] for c in inspect(engine).get_columns("ledger_model_versions")}
        assert rows(engine, "SELECT id, name FROM ledger_model_versions WHERE id = 3") == [(3, f"{NAME}-r3")]
        r.upgrade(ledger_url)
        assert rows(engine, "SELECT parent_version_id FROM ledger_model_versions WHERE id = 3") == [(1,)]
    finally:
        engine.dispose()


def test_upgrade_from_0003_leaves_manifests_unrecorded_until_first_written(ledger_url):
    """Versions of an older ledger have no manifest sha256: the first use computes it from the
    ledger's rows and records it, once; another one is refused from then on."""
    engine = make_engine(ledger_url)
    try:
        r.upgrade(ledger_url, "0003")
        tables = sa.MetaData()
        tables.reflect(engine)
        with engine.begin() as conn:
            conn.execute(
                tables.tables["ledger_backbones"].insert(),
                [dict(id=1, name="org/tiny", revision="rev-1", created_at=NOW)],
            )
            conn.execute(
                tables.tables["ledger_registered_models"].insert(),
                [dict(id=1, name="org--tiny.code", backbone_id=1, line="code", created_at=NOW)],
            )
            conn.execute(
                tables.tables["ledger_model_versions"].insert(),
                [dict(id=1, registered_model_id=1, name="tiny-base", status="active", created_at=NOW)],
            )
        r.upgrade(ledger_url)
        assert rows(engine, "SELECT id, manifest_sha256 FROM ledger_model_versions") == [(1, None)]

        with r.Ledger(ledger_url) as ledger:
            assert r.recorded_manifest_sha256(ledger, 1) is None
            sha = r.release_manifest_sha256(ledger, 1)
            assert r.recorded_manifest_sha256(ledger, 1) == sha == r.release_manifest_sha256(ledger, 1)
            with pytest.raises(r.ArtifactError, match=sha):
                record_manifest_sha256(ledger, 1, "1" * 64, "x/manifest.json")

        r.downgrade(ledger_url, "0003")
        assert "manifest_sha256" not in {c["name"] for c in inspect(engine).get_columns("ledger_model_versions")}
        assert rows(engine, "SELECT id, name FROM ledger_model_versions") == [(1, "tiny-base")]
    finally:
        engine.dispose()


def test_foreign_keys_are_enforced_again_after_migrating(ledger_url):
    """SQLite migrations run with foreign keys off; the ledger's own connections must not."""
    with r.init_db(ledger_url) as ledger:
        with pytest.raises(IntegrityError):
            with ledger.transaction() as s:
                s.add(ModelVersion(registered_model_id=999, name="orphan"))


def test_a_migration_that_would_leave_dangling_keys_changes_nothing(tmp_path):
    """SQLite only (PostgreSQL checks every key itself): the check after the batch copies
    refuses the upgrade, and the one transaction leaves the ledger at 0001."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    r.upgrade(url, "0001")
    with sqlite3.connect(tmp_path / "ledger.db") as conn:  # foreign keys are off by default here
        conn.execute(
            "INSERT INTO ledger_registered_models (id, name, backbone_id, skill, created_at) "
            "VALUES (1, 'orphan.code', 42, 'code', '2026-12-01 00:00:00')"
        )
    with pytest.raises(RuntimeError, match="dangling foreign keys"):
        r.upgrade(url)
    engine = make_engine(url)
    try:
        assert rows(engine, f"SELECT version_num FROM {VERSION_TABLE}") == [("0001",)]
        assert "skill" in {c["name"] for c in inspect(engine).get_columns("ledger_registered_models")}
    finally:
        engine.dispose()
