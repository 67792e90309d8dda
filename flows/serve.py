"""Serving the `update` deployment from one process, and what Prefect knows about it.

`serve_update` reads the `update` deployment of deploy/prefect.yaml (schedule, parameters)
and serves it with `flow.serve`: the process registers the deployment and runs each
scheduled (or manually triggered) cycle itself; no work pool or worker is needed. Without
PREFECT_API_URL, Prefect runs in local mode with its database under the state folder.
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import yaml

from atlas_core.paths import PROJECT_ROOT

PREFECT_FILE = PROJECT_ROOT / "deploy" / "prefect.yaml"
DEPLOYMENT = "update"


def deployment_spec(name: str = DEPLOYMENT, path: Path = PREFECT_FILE) -> dict:
    """One deployment's entry of deploy/prefect.yaml."""
    data = yaml.safe_load(path.read_text())
    for spec in data.get("deployments", []):
        if spec.get("name") == name:
            return spec
    raise ValueError(f"{path}: no deployment named {name!r}")


def serve_update(cron: str | None = None, **overrides) -> None:
    """Serve `update` with the yaml's schedule (or `cron`) and parameters (overridden where given).

    A parameter the yaml does not set is left to the flow's config file: `--config my.yaml`
    takes its backbone, skill and line from my.yaml unless --backbone / --skill / --line are given."""
    from .update import update

    spec = deployment_spec()
    schedule = spec["schedules"][0]
    parameters = {**spec.get("parameters", {}), **{k: v for k, v in overrides.items() if v is not None}}
    print(f"serving deployment update/{DEPLOYMENT}: cron '{cron or schedule['cron']}' ({schedule.get('timezone', 'UTC')}), "
          f"parameters {parameters}; Ctrl-C stops")
    update.serve(name=DEPLOYMENT, cron=cron or schedule["cron"], parameters=parameters,
                 description=spec.get("description"), tags=spec.get("tags"))


def prefect_status(limit: int = 5) -> str:
    """Last `update` flow runs and the next scheduled one, from the Prefect API (or local database)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterState, \
        FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    flows = FlowFilter(name=FlowFilterName(any_=["update"]))
    lines = ["Prefect (flow 'update'):"]
    with get_client(sync_client=True) as client:
        scheduled = client.read_flow_runs(flow_filter=flows, sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1,
                                          flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                                              type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
        recent = client.read_flow_runs(flow_filter=flows, sort=FlowRunSort.START_TIME_DESC, limit=limit,
                                       flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                                           type=FlowRunFilterStateType(not_any_=[StateType.SCHEDULED]))))
    if scheduled:
        when = scheduled[0].expected_start_time
        lines.append(f"  next scheduled run: {when:%Y-%m-%d %H:%M %Z} ({_from_now(when)})")
    else:
        lines.append("  next scheduled run: none (serve with `atlas serve`, or deploy deploy/prefect.yaml)")
    for r in recent:
        start = f"{r.start_time:%Y-%m-%d %H:%M:%S}" if r.start_time else "not started"
        lines.append(f"  {start}  {r.name:24s} {r.state_name}")
    return "\n".join(lines)


def _from_now(when: datetime) -> str:
    minutes = (when - datetime.now(timezone.utc)).total_seconds() / 60
    return f"in {minutes / 60:.1f} h" if minutes > 90 else f"in {minutes:.0f} min"
