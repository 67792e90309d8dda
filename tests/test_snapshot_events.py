"""`atlas snapshot add` writes a snapshot completely and announces it; a served deployment's trigger
starts the line's cycle on exactly that snapshot."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows_fixtures import write_yaml
from tests.test_flows_continual import BASE, policy, write_pairs

REPO = Path(__file__).resolve().parent.parent


def _pairs(n: int = 8, start: int = 0) -> list[dict]:
    from evaluation.data import mbpp_pairs

    return mbpp_pairs("train")[start : start + n]


def test_snapshot_add_writes_it_complete_with_its_sidecar_and_once(tmp_path, monkeypatch, capsys):
    from atlas_core.io import sha256_file
    from flows.cli import main
    from flows.skills import resolve_snapshot

    monkeypatch.setenv("ATLAS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    file = write_pairs(tmp_path / "new.jsonl", _pairs())
    assert main(["snapshot", "add", file, "--line", "assistant", "--skill", "a"]) == 0
    out = capsys.readouterr().out
    assert "8 pairs" in out and "event: none (PREFECT_API_URL is not set)" in out
    folder = tmp_path / "state" / "snapshots" / "assistant" / "a"
    written = sorted(p.name for p in folder.iterdir())
    assert len(written) == 2 and written[1] == written[0] + ".sha256"  # no temporary file left behind
    snapshot = folder / written[0]
    assert snapshot.read_bytes() == Path(file).read_bytes()
    assert (folder / written[1]).read_text() == f"{sha256_file(snapshot)}  {snapshot.name}\n"
    assert resolve_snapshot(folder) == snapshot  # a cycle pointed at the folder takes it

    assert main(["snapshot", "add", file, "--line", "assistant", "--skill", "a"]) == 0  # the same content again
    assert len(list(folder.iterdir())) == 2 and str(snapshot) in capsys.readouterr().out

    time.sleep(0.01)
    newer = write_pairs(tmp_path / "newer.jsonl", _pairs(start=8))
    assert main(["snapshot", "add", newer, "--line", "assistant", "--skill", "a"]) == 0
    assert resolve_snapshot(folder).read_bytes() == Path(newer).read_bytes()  # the newest sorts last


@pytest.mark.parametrize(
    "content, args, expected",
    [
        ('{"id": "1", "prompt": "p"}\n', ["--skill", "a"], "response"),
        ("", ["--skill", "a"], "no rows"),
        ('{"id": "1", "prompt": "p", "response": "r"}\n', ["--skill", "a b"], "--skill: expected a name"),
    ],
)
def test_snapshot_add_refuses_bad_input_in_one_line_and_writes_nothing(
    tmp_path, monkeypatch, capsys, content, args, expected
):
    from flows.cli import main

    monkeypatch.setenv("ATLAS_STATE_DIR", str(tmp_path / "state"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    assert main(["snapshot", "add", str(bad), "--line", "assistant", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atlas snapshot: error:") and expected in err[0]
    assert not list((tmp_path / "state").rglob("*.jsonl"))


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the serving process exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        time.sleep(1)
    pytest.fail(f"{what}: not within {timeout} s" + (f"\n{log.read_text()[-4000:]}" if log else ""))


def test_a_snapshot_added_starts_the_served_deployment_through_its_trigger(prefect_harness, state, tmp_path):
    """`atlas serve`'s way of serving (flows/serve.py) a deployment whose only start is its trigger;
    `atlas snapshot add` emits the event; the trigger runs `update` on that snapshot to promotion."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL

    from atlas_core.io import sha256_file
    from flows.platform import open_platform
    from registry import alias_holder, get_model, training_run_config

    held = write_pairs(tmp_path / "held.jsonl", _pairs(4, start=40))
    folder = state / "snapshots" / "assistant" / "a"
    config = BASE | {
        "name": "a",
        "skill": "a",
        "data": {"source": str(folder), "val_source": held, "val_limit": 4},
        "target": {"scorer": "reference-nll", "options": {"source": held, "limit": 4}},
    }
    deployment = {
        "name": "tiny-a",
        "parameters": {
            "config": write_yaml(tmp_path / "a.yaml", config),
            "policy": write_yaml(tmp_path / "pass.yaml", policy("tiny-pass")),
        },
        "triggers": [
            {
                "type": "event",
                "enabled": True,
                "match": {"prefect.resource.id": "atlas.snapshot.assistant.a"},
                "expect": ["atlas.snapshot.added"],
                "parameters": {"snapshot": "{{ event.payload.path }}"},
            }
        ],
    }
    prefect_file = write_yaml(tmp_path / "prefect.yaml", {"deployments": [deployment]})
    url = PREFECT_API_URL.value()
    env = os.environ | {"PREFECT_API_URL": url, "PYTHONPATH": str(REPO), "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    serve = (
        "import sys; from pathlib import Path; from flows.serve import serving_plan, serve_update; "
        "serve_update(serving_plan(['tiny-a'], path=Path(sys.argv[1])))"
    )
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", serve, prefect_file], cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    try:
        with get_client(sync_client=True) as client:

            def served():
                try:
                    d = client.read_deployment_by_name("update/tiny-a")
                except Exception:
                    return None
                return d if any(a.name.startswith("tiny-a") for a in client.read_automations()) else None

            served_deployment = _wait("the served deployment and its trigger", served, 120, proc, log)
            added = subprocess.run(
                [sys.executable, "-m", "flows.cli", "snapshot", "add", write_pairs(tmp_path / "s.jsonl", _pairs())]
                + ["--line", "assistant", "--skill", "a"],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert added.returncode == 0 and "event: atlas.snapshot.added sent" in added.stdout, added
            snapshot = next(p for p in folder.glob("*.jsonl"))

            def finished():
                runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[served_deployment.id]))
                )
                return [r for r in runs if r.state is not None and r.state.is_final()]

            runs = _wait("the triggered cycle", finished, 420, proc, log)
        assert len(runs) == 1 and runs[0].state.is_completed(), (runs, log.read_text()[-4000:])
        assert runs[0].parameters["snapshot"] == str(snapshot)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    p = open_platform()
    try:
        champion = alias_holder(p.ledger, get_model(p.ledger, "tiny-llama.assistant").id)
        assert champion is not None and champion.skill == "a"
        run = training_run_config(p.ledger, champion.training_run_id)
        assert run["skill_sha256"] == sha256_file(snapshot)  # trained on exactly the added snapshot
    finally:
        p.close()
