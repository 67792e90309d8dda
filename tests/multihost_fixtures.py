"""One machine as several hosts: a Prefect server and an MLflow tracking server on the PostgreSQL at
127.0.0.1:5432, the ledger there too, and whatever processes a test starts against them (workers,
cycles). Everything listens on 127.0.0.1; every wait is bounded; everything is torn down."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

from atlas_core.paths import data_dir
from tests.conftest_registry import PG_HOST, PG_PORT, _admin, postgres_user

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PREFECT = str(BIN / "prefect")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
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


def run(cmd: list[str], env: dict, timeout: float = 180) -> str:
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the process's own children (uvicorn workers, flow runs) too
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@contextmanager
def servers(tmp_path: Path) -> Iterator[tuple[dict, Callable[..., subprocess.Popen]]]:
    """(the environment of a client or worker of the servers, start(cmd, env, name) -> process whose
    output goes to tmp_path/<name>.log, in a session of its own, stopped at the end)."""
    user, why = postgres_user()
    if user is None:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:10]
    dbs = {k: f"atlas_{k}_{tag}" for k in ("prefect", "mlflow", "ledger")}
    for name in dbs.values():
        _admin(user, f'CREATE DATABASE "{name}"')
    pg = f"{user}@{PG_HOST}:{PG_PORT}"
    prefect_port, mlflow_port = free_port(), free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "ATLAS_", "MLFLOW_"))}
    base |= {
        "ATLAS_DATA_DIR": str(data_dir())
    }  # the data the test process reads (a checkout elsewhere has no ../shared)
    base |= {
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
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
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
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
        wait_http(f"http://127.0.0.1:{prefect_port}/api/health", 180, server, tmp_path / "prefect-server.log")
        wait_http(f"http://127.0.0.1:{mlflow_port}/health", 180, mlflow, tmp_path / "mlflow-server.log")
        yield client, start
    finally:
        for proc in reversed(procs):
            stop(proc)
        for name in dbs.values():
            _admin(user, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
