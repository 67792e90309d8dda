"""Multi-host setup, tested on one machine: a Prefect server and an MLflow tracking server, both
on the PostgreSQL at 127.0.0.1:5432, the ledger on PostgreSQL too, a process work pool and a
worker. The `update` deployment of deploy/prefect.yaml is deployed with the Prefect CLI,
triggered with tiny-model parameters, picked up by the worker and run to COMPLETED.
Everything listens on 127.0.0.1; every wait is bounded; everything is torn down."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from atlas_core.paths import data_dir
from tests.conftest_registry import PG_HOST, PG_PORT, _admin, postgres_user
from tests.flows_fixtures import PASSING_POLICY, tiny_files

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{url}: server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


def _run(cmd: list[str], env: dict, timeout: float = 180) -> str:
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own children (uvicorn workers, flow runs) too
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_worker_runs_a_deployed_update_against_postgres_servers(tmp_path):
    user, why = postgres_user()
    if user is None:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:10]
    dbs = {k: f"atlas_{k}_{tag}" for k in ("prefect", "mlflow", "ledger")}
    for name in dbs.values():
        _admin(user, f'CREATE DATABASE "{name}"')
    pg = f"{user}@{PG_HOST}:{PG_PORT}"
    prefect_port, mlflow_port = _free_port(), _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "ATLAS_", "MLFLOW_"))}
    base |= {
        "ATLAS_DATA_DIR": str(data_dir())
    }  # the data the test process reads (a checkout elsewhere has no ../shared)
    base |= {
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
    }
    client = base | {
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "ATLAS_LEDGER_URL": f"postgresql://{pg}/{dbs['ledger']}",
        "ATLAS_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
        "ATLAS_ARTIFACT_STORE": str(tmp_path / "store"),
        "ATLAS_STATE_DIR": str(tmp_path / "worker-state"),
        "ATLAS_PROJECT_DIR": str(REPO),
    }
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], env: dict, name: str) -> subprocess.Popen:
        log = tmp_path / f"{name}.log"
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        procs.append(proc)
        return proc

    try:
        server = start(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            base | {"PREFECT_API_DATABASE_CONNECTION_URL": f"postgresql+asyncpg://{pg}/{dbs['prefect']}"},
            "prefect-server",
        )
        mlflow = start(
            [
                str(BIN / "mlflow"),
                "server",
                "--backend-store-uri",
                f"postgresql+psycopg://{pg}/{dbs['mlflow']}",
                "--artifacts-destination",
                str(tmp_path / "mlflow-artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(mlflow_port),
                "--workers",
                "1",
            ],
            base,
            "mlflow-server",
        )
        _wait_http(f"http://127.0.0.1:{prefect_port}/api/health", 180, server, tmp_path / "prefect-server.log")
        _wait_http(f"http://127.0.0.1:{mlflow_port}/health", 180, mlflow, tmp_path / "mlflow-server.log")

        prefect = str(BIN / "prefect")
        _run([prefect, "work-pool", "create", "atlas-test", "--type", "process"], client)
        _run(
            [
                prefect,
                "--no-prompt",
                "deploy",
                "--prefect-file",
                "deploy/prefect.yaml",
                "--name",
                "update",
                "--pool",
                "atlas-test",
            ],
            client,
        )
        start([prefect, "worker", "start", "--pool", "atlas-test", "--type", "process"], client, "worker")

        config, policy = tiny_files(
            tmp_path / "cfg", PASSING_POLICY | {"candidates": {"methods": ["atlas"], "seeds": [0]}}
        )
        params = {"config": config, "policy": policy, "backbone": "tiny-llama", "skill": "tiny-code"}
        trigger = (
            "import json, sys; from prefect.deployments import run_deployment; "
            "r = run_deployment('update/update', parameters=json.loads(sys.argv[1]), timeout=0); print(r.id)"
        )
        run_id = _run([sys.executable, "-c", trigger, json.dumps(params)], client).strip().splitlines()[-1]

        import httpx

        deadline, state = time.monotonic() + 600, None
        while time.monotonic() < deadline:
            state = httpx.get(f"{client['PREFECT_API_URL']}/flow_runs/{run_id}", timeout=10).json()["state"]
            if state and state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            time.sleep(3)
        assert state and state["type"] == "COMPLETED", (
            f"flow run {run_id}: {state}\n{(tmp_path / 'worker.log').read_text()[-4000:]}"
        )

        # The worker's cycle wrote to the PostgreSQL ledger and the MLflow server.
        from mlflow import MlflowClient

        from registry import alias_holder, get_model, init_db

        with init_db(client["ATLAS_LEDGER_URL"]) as ledger:
            model = get_model(ledger, "tiny-llama.tiny-code")
            champion = alias_holder(ledger, model.id)
        assert champion is not None
        remote = MlflowClient(
            tracking_uri=client["ATLAS_MLFLOW_TRACKING_URI"], registry_uri=client["ATLAS_MLFLOW_TRACKING_URI"]
        )
        assert remote.get_registered_model(model.name).aliases["champion"] == champion.mlflow_version
    finally:
        for proc in reversed(procs):
            _stop(proc)
        for name in dbs.values():
            _admin(user, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
