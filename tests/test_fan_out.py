"""The multi-host setup on one machine, with candidates fanned out over a Prefect work pool
(`execution.candidates: work-pool`): PostgreSQL ledger, Prefect and MLflow servers on PostgreSQL,
process workers on loopback (tests/multihost_fixtures.py); deploy/prefect.yaml's `update` and
`candidate` deployments deployed with the Prefect CLI (docs/FLOWS.md, "Multi-host").

1. The `update` deployment, run by a worker, runs its two candidates in two other workers at once
   (their flow runs' intervals overlap); its gate decisions and metrics equal those of the same
   cycle run in-process, and the champion moved in the ledger and on the MLflow server.
2. A worker killed while its candidate trains: the cycle marks the silent flow run crashed, records
   the candidate failed with the reason, and the policy (require_all) rejects the cycle; the rerun
   resumes the killed training from its last checkpoint and does not retrain or re-evaluate the other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.flows_fixtures import PASSING_POLICY, TINY_CONFIG, write_yaml
from tests.multihost_fixtures import PREFECT, REPO, run, servers

pytestmark = pytest.mark.slow
CYCLE = (
    "import json, sys; from flows.platform import configure_environment; configure_environment(); "
    "from flows.update import update; print('RESULT ' + json.dumps(update(sys.argv[1], sys.argv[2]).to_dict()))"
)
WORK_POOL = {"candidates": "work-pool", "heartbeat_timeout_s": 50, "poll_seconds": 2}  # heartbeats every 30 s


def _start_cycle(config: str, policy: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CYCLE, config, policy],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _result(proc: subprocess.Popen, timeout: float = 900) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"the cycle failed (exit {proc.returncode}):\n{out[-5000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def _candidate_runs(api_url: str, prefix: str) -> list:
    """The `candidate` flow runs whose names start with `prefix` (`<skill>-<method>-s<seed>`), by name."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["candidate"])))
    return sorted((r for r in runs if r.name.startswith(prefix)), key=lambda r: r.name)


def _final_state(api_url: str, flow_run_id: str, timeout: float) -> dict:
    import httpx

    deadline, state = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        state = httpx.get(f"{api_url}/flow_runs/{flow_run_id}", timeout=10).json()["state"]
        if state and state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(2)
    pytest.fail(f"flow run {flow_run_id} did not end within {timeout} s: {state}")


def _champion(ledger_url: str, model: str):
    from registry import alias_holder, get_model, init_db

    with init_db(ledger_url) as ledger:
        return alias_holder(ledger, get_model(ledger, model).id)


def _decisions(ledger_url: str, model: str) -> dict:
    """version name -> [(check, passed, measured)] of its newest gate decision."""
    from registry import get_model, init_db, latest_gate_decision, list_versions

    with init_db(ledger_url) as ledger:
        versions = list_versions(ledger, get_model(ledger, model).id)
        decisions = {v.name: latest_gate_decision(ledger, v.id) for v in versions if not v.is_base}
    return {name: [(c.name, c.passed, c.measured) for c in d.checks] for name, d in decisions.items() if d}


def _training_runs(ledger_url: str, skill: str) -> dict:
    from registry import init_db
    from registry import models as m

    with init_db(ledger_url) as ledger, ledger.transaction() as s:
        runs = s.query(m.TrainingRun).filter(m.TrainingRun.skill == skill).all()
        out = {}
        for r in runs:
            steps = [c.step for c in s.query(m.Checkpoint).filter(m.Checkpoint.training_run_id == r.id)]
            out[r.method] = {"id": r.id, "status": r.status, "failure": r.failure, "steps": sorted(steps)}
            out[r.method]["finished_at"] = r.finished_at
        return out


def _kill_worker_of(pid: int, workers: list[subprocess.Popen]) -> subprocess.Popen:
    """SIGKILL the worker whose flow-run process is `pid`, with everything it started."""
    import psutil

    chain = {p.pid for p in psutil.Process(pid).parents()} | {pid}
    worker = next(w for w in workers if w.pid in chain)
    os.killpg(worker.pid, signal.SIGKILL)
    if psutil.pid_exists(pid):
        os.kill(pid, signal.SIGKILL)
    worker.wait(timeout=30)
    return worker


def test_candidates_fan_out_over_two_workers_and_a_killed_one_fails_then_resumes(tmp_path):
    with servers(tmp_path) as (client_env, start):
        api, ledger_url = client_env["PREFECT_API_URL"], client_env["ATLAS_LEDGER_URL"]
        run([PREFECT, "work-pool", "create", "atlas-test", "--type", "process"], client_env)
        deploy = [PREFECT, "--no-prompt", "deploy", "--prefect-file", "deploy/prefect.yaml"]
        for name in ("update", "candidate"):  # one at a time: with several names, prefect deploy ignores --pool
            run([*deploy, "--name", name, "--pool", "atlas-test"], client_env)
        worker = [PREFECT, "worker", "start", "--pool", "atlas-test", "--type", "process", "--limit", "1"]
        workers = [start([*worker, "--name", f"w{i}"], client_env, f"worker{i}") for i in (0, 1, 2)]

        # 1. The `update` deployment, run by one worker, fans its two candidates (ATLAS, Weight-LoRA)
        #    out to the two others at once; the same cycle in-process gives the same decisions.
        cfg = tmp_path / "cfg"
        cfg.mkdir()
        policy = write_yaml(cfg / "pass.yaml", PASSING_POLICY)
        pooled = write_yaml(cfg / "pooled.yaml", TINY_CONFIG | {"execution": WORK_POOL})
        trigger = (
            "import json, sys; from prefect.deployments import run_deployment; "
            "r = run_deployment('update/update', parameters=json.loads(sys.argv[1]), timeout=0); print(r.id)"
        )
        params = json.dumps({"config": pooled, "policy": policy})
        cycle_run = run([sys.executable, "-c", trigger, params], client_env).strip().splitlines()[-1]
        here = tmp_path / "in-process"
        embedded = {k: v for k, v in client_env.items() if not k.startswith(("PREFECT_API", "ATLAS_"))}
        embedded |= {"ATLAS_STATE_DIR": str(here), "ATLAS_DATA_DIR": client_env["ATLAS_DATA_DIR"]}
        embedded |= {"PREFECT_HOME": str(here / "prefect")}  # local mode: a temporary server of its own
        local = _result(_start_cycle(write_yaml(cfg / "local.yaml", TINY_CONFIG), policy, embedded))
        state = _final_state(api, cycle_run, 600)
        assert state["type"] == "COMPLETED", f"{state}\n" + "".join(
            (tmp_path / f"worker{i}.log").read_text()[-3000:] for i in (0, 1, 2)
        )

        pooled_decisions = _decisions(ledger_url, local["model"])
        local_decisions = _decisions(f"sqlite:///{here}/ledger.db", local["model"])
        # 2 methods x 2 epochs; if one is missing, say why its candidate failed
        assert pooled_decisions.keys() == local_decisions.keys() and len(pooled_decisions) == 4, (
            f"pooled candidates: {_training_runs(ledger_url, 'tiny-code')}\n"
            + "".join((tmp_path / f"worker{i}.log").read_text()[-3000:] for i in (0, 1, 2))
        )
        for name, checks in pooled_decisions.items():
            assert [c[:2] for c in checks] == [c[:2] for c in local_decisions[name]], name
            for (check, _, a), (_, _, b) in zip(checks, local_decisions[name]):
                assert a == pytest.approx(b, rel=1e-4, abs=1e-6), (name, check)
        assert {n: all(c[1] for c in checks) for n, checks in pooled_decisions.items()} == local["candidates"]
        champion = _champion(ledger_url, local["model"])
        assert local["outcome"] == "promoted" and champion.name == local["champion"] == local["selected"]
        from mlflow import MlflowClient  # the worker published to the MLflow server: its alias moved too

        # registry_uri too: an earlier test in this process may have set MLFLOW_REGISTRY_URI
        server = client_env["ATLAS_MLFLOW_TRACKING_URI"]
        remote = MlflowClient(tracking_uri=server, registry_uri=server)
        assert remote.get_registered_model(local["model"]).aliases["champion"] == champion.mlflow_version

        first = _candidate_runs(api, "tiny-code-")
        assert [r.state.type.value for r in first] == ["COMPLETED", "COMPLETED"]
        assert max(r.start_time for r in first) < min(r.end_time for r in first), "candidates ran one after another"

        # 2. A longer training on a new line; its worker is killed after the first checkpoint.
        slow = TINY_CONFIG | {
            "skill": "slow",
            "data": TINY_CONFIG["data"] | {"train_limit": 48},
            "train": TINY_CONFIG["train"] | {"epochs": 3, "checkpoint_every_steps": 3},
            "execution": WORK_POOL,
        }
        slow_config = write_yaml(cfg / "slow.yaml", slow)
        cycle = _start_cycle(slow_config, policy, client_env)
        deadline, victim = time.monotonic() + 600, None
        while victim is None and time.monotonic() < deadline:
            assert cycle.poll() is None, cycle.communicate()[0][-5000:]
            runs = _training_runs(ledger_url, "slow")
            victim = next((m for m, r in runs.items() if r["status"] == "running" and r["steps"]), None)
            time.sleep(0.5)
        assert victim is not None, "no candidate reached its first checkpoint"
        flow_run = _candidate_runs(api, f"slow-{victim}-s0")[0]
        pid = int(str(flow_run.infrastructure_pid).rsplit(":", 1)[-1])  # "pid", or "host:pid"
        killed = _kill_worker_of(pid, workers)
        before = _training_runs(ledger_url, "slow")[victim]

        failed = _result(cycle)
        assert failed["outcome"] == "rejected" and list(failed["failed"]) == [f"{victim} s0"]
        assert "no heartbeat" in failed["failed"][f"{victim} s0"]
        runs = _training_runs(ledger_url, "slow")
        other = next(m for m in runs if m != victim)
        assert runs[victim]["status"] == "failed" and "no heartbeat" in runs[victim]["failure"]
        assert runs[other]["status"] == "finished"

        # The rerun, on the worker left plus a new one: the killed training resumes, the other is reused.
        workers.remove(killed)
        workers.append(start([*worker, "--name", "w3"], client_env, "worker3"))
        rerun = _result(_start_cycle(slow_config, policy, client_env))
        assert rerun["outcome"] == "promoted" and not rerun["failed"]
        after = _training_runs(ledger_url, "slow")
        assert after[other] == runs[other]  # not retrained: same row, same checkpoints, same finish time
        assert after[victim]["id"] == before["id"] and after[victim]["status"] == "finished"
        assert after[victim]["steps"][: len(before["steps"])] == before["steps"]  # nothing recorded twice
        logs = "".join((tmp_path / f"worker{i}.log").read_text() for i in (0, 1, 2, 3))
        assert "resumed from" in logs, logs[-3000:]  # the killed training went on from its checkpoint
