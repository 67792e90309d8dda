"""Multi-host setup, tested on one machine: a Prefect server and an MLflow tracking server, both
on the PostgreSQL at 127.0.0.1:5432, the ledger on PostgreSQL too, a process work pool and a
worker. The `update` deployment of deploy/prefect.yaml is deployed with the Prefect CLI,
triggered with tiny-model parameters, picked up by the worker and run to COMPLETED.
Everything listens on 127.0.0.1; every wait is bounded; everything is torn down."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.flows_fixtures import PASSING_POLICY, tiny_files
from tests.multihost_fixtures import PREFECT, run, servers

pytestmark = pytest.mark.slow


def test_worker_runs_a_deployed_update_against_postgres_servers(tmp_path):
    with servers(tmp_path) as (client, start):
        run([PREFECT, "work-pool", "create", "atlas-test", "--type", "process"], client)
        run(
            [
                PREFECT,
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
        start([PREFECT, "worker", "start", "--pool", "atlas-test", "--type", "process"], client, "worker")

        config, policy = tiny_files(
            tmp_path / "cfg", PASSING_POLICY | {"candidates": {"methods": ["atlas"], "seeds": [0]}}
        )
        params = {"config": config, "policy": policy, "backbone": "tiny-llama", "skill": "tiny-code"}
        trigger = (
            "import json, sys; from prefect.deployments import run_deployment; "
            "r = run_deployment('update/update', parameters=json.loads(sys.argv[1]), timeout=0); print(r.id)"
        )
        run_id = run([sys.executable, "-c", trigger, json.dumps(params)], client).strip().splitlines()[-1]

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
