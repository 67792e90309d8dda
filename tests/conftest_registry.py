"""Shared fixtures and helpers of the registry tests (import them into a test module).

`ledger_url` gives every test a fresh, empty database: a SQLite file in tmp_path, and a
uniquely named PostgreSQL database on 127.0.0.1:5432 that is dropped afterwards. The
PostgreSQL case skips, with the reason, only when no server answers.

Run as `python -m tests.conftest_registry promote ...`, this file is also the worker
process of the race and crash tests.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"

PG_HOST, PG_PORT, PG_DB = "127.0.0.1", 5432, "test"
PG_USERS = ("postgres", "root")
REPO_ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def postgres_user() -> tuple[Optional[str], str]:
    """(user, "") for the first user that can connect, or (None, why not)."""
    import psycopg

    errors = []
    for user in PG_USERS:
        try:
            with psycopg.connect(host=PG_HOST, port=PG_PORT, dbname=PG_DB, user=user, connect_timeout=3):
                return user, ""
        except psycopg.Error as e:
            errors.append(f"{user}: {str(e).strip().splitlines()[0]}")
    return None, f"no PostgreSQL server usable at {PG_HOST}:{PG_PORT}/{PG_DB} ({'; '.join(errors)})"


def _admin(user: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(host=PG_HOST, port=PG_PORT, dbname=PG_DB, user=user, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request, tmp_path):
    """An empty database URL for the ledger, on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    user, why = postgres_user()
    if user is None:
        pytest.skip(why)
    name = f"registry_test_{uuid.uuid4().hex[:12]}"
    _admin(user, f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://{user}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        _admin(user, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def ledger(ledger_url):
    from registry import init_db

    with init_db(ledger_url) as opened:
        yield opened


@pytest.fixture
def store(tmp_path):
    from registry import ArtifactStore

    return ArtifactStore(tmp_path / "store")


@pytest.fixture(scope="module")
def mlflow_config(tmp_path_factory):
    """One MLflow tracking database per test module (creating one takes about a second)."""
    from registry import MlflowConfig

    return MlflowConfig.local(tmp_path_factory.mktemp("mlflow-state"))


@pytest.fixture(scope="module")
def bridge(mlflow_config):
    from registry import MlflowBridge

    return MlflowBridge(mlflow_config)


def unique_backbone() -> str:
    """Tests share an MLflow database per module; distinct backbones keep their models apart."""
    return f"tests/tiny-{uuid.uuid4().hex[:8]}"


def make_candidates(ledger, store, backbone: str, skill: str = "gsm8k", seeds=(0, 1, 2), epoch: int = 1):
    """A backbone with an atlas and one checkpoint per seed, each registered as a version.

    Returns (model_id, [VersionInfo per seed]); adapter and atlas bytes are distinct per call.
    """
    import registry as r

    backbone_id = r.ensure_backbone(ledger, backbone, "rev-1")
    atlas_bytes = f"atlas of {backbone}".encode()
    atlas = r.record_atlas(
        ledger, r.sha256_bytes(atlas_bytes + b"#key"), backbone_id, 2, {"rank": 4}, store.put_bytes(atlas_bytes)
    )
    versions = []
    for seed in seeds:
        run_id = r.start_training_run(ledger, backbone_id, skill, "atlas", seed, {"lr": 0.001}, atlas_id=atlas.id)
        adapter = store.put_bytes(f"adapter {backbone} seed {seed}".encode())
        ckpt = r.record_checkpoint(ledger, run_id, epoch, 10 * epoch, adapter, {"loss": 1.0 / (seed + 1)})
        versions.append(r.register_version(ledger, ckpt.id))
    return versions[0].model_id, versions


def gate_pass(ledger, version_id: int, against: Optional[int]):
    """Record a passing gate decision of `version_id` measured against champion `against`."""
    import registry as r

    return r.record_gate_decision(
        ledger,
        version_id,
        "test-policy",
        {"max_kl": 0.05},
        [r.GateCheckRecord("kl_vs_release", 0.05, 0.01, True)],
        release_version_id=against,
    )


# -- worker process of the race and crash tests -------------------------------------------


def _worker(args: dict) -> None:
    import registry as r

    ledger = r.Ledger(args["ledger_url"])
    bridge = r.MlflowBridge(r.MlflowConfig(args["tracking_uri"], args["artifact_root"]))
    stamps = {}
    if args["mode"] == "race":
        stamps = _race_barrier(args, ledger)
        Path(args["ready"]).write_text("ready")
        while not all(Path(p).exists() for p in args["wait_for"]):
            time.sleep(0.01)
    elif args["mode"] == "crash":
        # Die (SIGKILL: no cleanup) right after the ledger commit, before MLflow moves.
        r.MlflowBridge.set_alias = lambda *a, **k: os.kill(os.getpid(), 9)
    try:
        release = r.promote(ledger, bridge, args["version_id"], reason=args["reason"])
        print(json.dumps({"won": True, "release_id": release.id, "stamps": stamps}))
    except r.PromotionConflict as e:
        print(json.dumps({"won": False, "error": str(e), "stamps": stamps}))


def _race_barrier(args: dict, ledger) -> dict:
    """Instrument this process's promotion so the race is decided by the lock, deterministically.

    Each process stamps `request` when it enters the promotion's transaction (its next statement
    blocks while the other holds the line's lock) and `acquired` once `lock_line` returned. The
    first to hold the lock (an O_EXCL file decides) waits, holding it, until the other has
    requested it (and, on PostgreSQL, until the server shows that backend waiting on a lock),
    then commits (stamping `committing` just before). The loser therefore asked for the lock before the winner
    released it and got it after: it lost on the lock, and the test checks those stamps."""
    import registry.db as db
    import registry.promotion as promotion

    stamps, me, other = {}, args["me"], args["other"]
    real_transaction, real_lock, real_decision = db.Ledger.transaction, promotion.lock_line, promotion._passing_decision

    def transaction(self):
        from contextlib import contextmanager

        @contextmanager
        def stamped():
            stamps.setdefault("request", time.time())
            Path(me).write_text("requested")
            with real_transaction(self) as s:
                yield s
                if stamps.get("acquired") and "committing" not in stamps:  # the transaction holding the lock,
                    stamps["committing"] = time.time()  # stamped just before its commit releases the lock

        return stamped()

    def lock_line(session, model_id):
        row = real_lock(session, model_id)
        stamps["acquired"] = time.time()
        return row

    def decision_then_hold(session, version_id):
        decision = real_decision(session, version_id)
        try:
            os.close(os.open(args["holder"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return decision  # the other process held the lock first
        stamps["held_first"] = True
        deadline = time.time() + 60
        while not Path(other).exists() or (ledger.url.startswith("postgresql") and not _pg_lock_waiters(ledger.url)):
            if time.time() > deadline:
                raise TimeoutError("the other promotion never asked for the lock")
            time.sleep(0.01)
        return decision

    db.Ledger.transaction, promotion.lock_line, promotion._passing_decision = transaction, lock_line, decision_then_hold
    return stamps


def _pg_lock_waiters(url: str) -> int:
    """Backends of this database now waiting on a lock (PostgreSQL's own view of the race)."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    with psycopg.connect(host=u.host, port=u.port, dbname=u.database, user=u.username, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()[0]


def run_worker(args: dict, background: bool = False):
    """Start the worker with `args`; returns the Popen (background) or CompletedProcess."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "tests.conftest_registry", json.dumps(args)]
    if background:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
