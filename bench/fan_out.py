"""Candidates fanned out over a Prefect work pool, one candidate worker against two.

One cycle of two candidates (ATLAS and Weight-LoRA, seed 0) on the default backbone
(configs/update/ci.yaml with configs/policy/ci.yaml's gate) run three ways on this machine:
    in-process   the embedded default (`execution.candidates: in-process`), `atlas update` in local mode
    1 worker     `execution.candidates: work-pool`: each candidate a flow run of the `candidate`
                 deployment; one process worker takes them, one after the other
    2 workers    the same with two process workers: both candidates at once
Each way starts from nothing (the work-pool ways on fresh servers: the multi-host test's PostgreSQL
ledger, Prefect and MLflow servers and process workers on loopback, tests/multihost_fixtures.py; a
third worker runs the cycle's own flow run). Printed: the cycle's wall time and each candidate's
flow-run interval. Two candidates at once can be at most 2x faster than one after the other, and
only with a core per candidate's threads: on 2 cores they share what one had.

    .venv/bin/python bench/fan_out.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import machine, reading  # noqa: E402

CONFIG, POLICY = ROOT / "configs" / "update" / "ci.yaml", ROOT / "configs" / "policy" / "ci.yaml"
TRIGGER = (
    "import json, sys; from prefect.deployments import run_deployment; "
    "r = run_deployment('update/update', parameters=json.loads(sys.argv[1]), timeout=0); print(r.id)"
)


def in_process(tmp: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "ATLAS_STATE"))}
    env |= {"ATLAS_STATE_DIR": str(tmp / "state"), "PREFECT_HOME": str(tmp / "prefect"), "OMP_WAIT_POLICY": "PASSIVE"}
    start = time.perf_counter()
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "atlas"), "update", "--config", str(CONFIG), "--policy", str(POLICY)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"in-process cycle failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def pooled(tmp: Path, workers: int) -> tuple[float, list[tuple[str, float, float]]]:
    """(the cycle flow run's wall seconds, [(candidate, start, end) in seconds after the cycle started])."""
    from tests.multihost_fixtures import PREFECT, run, servers

    tmp.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(CONFIG.read_text()) | {"execution": {"candidates": "work-pool", "poll_seconds": 2}}
    (tmp / "pooled.yaml").write_text(yaml.safe_dump(config))
    with servers(tmp) as (env, start):
        run([PREFECT, "work-pool", "create", "bench", "--type", "process"], env)
        for name in ("update", "candidate"):
            run(
                [
                    PREFECT,
                    "--no-prompt",
                    "deploy",
                    "--prefect-file",
                    "deploy/prefect.yaml",
                    "--name",
                    name,
                    "--pool",
                    "bench",
                ],
                env,
            )
        worker = [PREFECT, "worker", "start", "--pool", "bench", "--type", "process", "--limit", "1"]
        for i in range(workers + 1):  # one more for the cycle's own flow run
            start([*worker, "--name", f"w{i}"], env, f"worker{i}")
        params = json.dumps({"config": str(tmp / "pooled.yaml"), "policy": str(POLICY)})
        cycle_id = run([sys.executable, "-c", TRIGGER, params], env).strip().splitlines()[-1]
        return _intervals(env["PREFECT_API_URL"], cycle_id)


def _intervals(api: str, cycle_id: str, timeout: float = 1800) -> tuple[float, list[tuple[str, float, float]]]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            cycle = client.read_flow_run(cycle_id)
            if cycle.state is not None and cycle.state.is_final():
                break
            time.sleep(2)
        if not cycle.state.is_completed():
            raise SystemExit(f"the pooled cycle ended {cycle.state.type.value}: {cycle.state.message}")
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["candidate"])))
    t0 = cycle.start_time
    spans = sorted((r.name, (r.start_time - t0).total_seconds(), (r.end_time - t0).total_seconds()) for r in runs)
    return (cycle.end_time - t0).total_seconds(), spans


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="atlas-fan-out-") as tmp:
        root = Path(tmp)
        seconds = {"in-process": in_process(root / "local")}
        spans = {}
        for workers in (1, 2):
            label = f"{workers} worker{'s' if workers > 1 else ''}"
            seconds[label], spans[label] = pooled(root / label.replace(" ", "-"), workers)
    print(f"machine: {machine()}")
    print(f"one cycle of two candidates (atlas, weight-lora) on {CONFIG.relative_to(ROOT)}, each way from nothing")
    for label, s in seconds.items():
        print(f"  {label:11s} cycle {s:6.1f} s")
        for name, begin, end in spans.get(label, []):
            print(f"      candidate {name:40s} {begin:6.1f} -> {end:6.1f} s ({end - begin:5.1f} s)")
    one, two = seconds["1 worker"], seconds["2 workers"]
    alone = [end - begin for _, begin, end in spans["1 worker"]]
    serial_part = sum(alone)  # what two at once could at best overlap
    ideal = one - serial_part + max(alone)
    print(
        f"  2 workers vs 1: {one / two:.2f}x faster; ideal (the longer candidate alone, everything else as with 1 "
        f"worker) {one / ideal:.2f}x; reached {(one - two) / max(one - ideal, 1e-9):.0%} of the ideal saving "
        f"on {os.cpu_count()} cores"
    )
    reading(
        "candidates over a work pool: 2 workers vs 1 (one cycle, two candidates)",
        f"cycle {one:.0f} s with 1 worker, {two:.0f} s with 2 ({one / two:.2f}x; ideal {one / ideal:.2f}x); "
        f"in-process {seconds['in-process']:.0f} s",
        "candidates in parallel; 2x needs a core per candidate",
        f"{(one - two) / max(one - ideal, 1e-9):.0%} of the ideal saving on {os.cpu_count()} cores",
    )


if __name__ == "__main__":
    main()
