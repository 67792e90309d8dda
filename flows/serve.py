"""Serving the `update` deployment from one process, and what Prefect knows about it.

`serving_plan` reads deployments of deploy/prefect.yaml (schedule, parameters; by default
every scheduled one, e.g. one per line or skill) and `serve_update` serves them all from one
process with `prefect.serve`: it registers the deployments and runs each scheduled (or
manually triggered) cycle itself; no work pool or worker is needed. Without
PREFECT_API_URL, Prefect runs in local mode with its database under the state folder.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import yaml

from atlas_core.errors import InputError
from atlas_core.paths import PROJECT_ROOT

PREFECT_FILE = PROJECT_ROOT / "deploy" / "prefect.yaml"
DEPLOYMENT = "update"
FLOW = "update"  # the cycle's flow (flows/update.py), whatever its deployments are called


def deployment_specs(path: Path = PREFECT_FILE) -> list[dict]:
    """Every deployment entry of deploy/prefect.yaml, in file order."""
    return yaml.safe_load(path.read_text()).get("deployments", [])


def deployment_spec(name: str = DEPLOYMENT, path: Path = PREFECT_FILE, specs: list[dict] | None = None) -> dict:
    """One deployment's entry of deploy/prefect.yaml (of `specs` when already read)."""
    for spec in specs if specs is not None else deployment_specs(path):
        if spec.get("name") == name:
            return spec
    raise InputError(f"{path}: no deployment named {name!r}")


def serving_plan(
    names: list[str] | None = None, cron: str | None = None, path: Path = PREFECT_FILE, **overrides
) -> list[dict]:
    """What `atlas serve` serves: the named deployments of deploy/prefect.yaml (default: every one
    with a schedule, e.g. one per line or skill), each with its schedule and parameters.

    `cron` and parameter overrides (config, policy, backbone, skill, line, snapshot) apply to a
    single deployment only; a parameter neither the yaml nor an override sets is left to the
    flow's config file (`--config my.yaml` takes its backbone, skill and line from my.yaml)."""
    given, specs = {k: v for k, v in overrides.items() if v is not None}, deployment_specs(path)
    if names is None:
        names = [d["name"] for d in specs if d.get("schedules")]
    if (given or cron) and len(names) != 1:
        raise InputError(
            f"serve: --cron and parameter overrides apply to one deployment; pick it with --deployment "
            f"(serving {names})"
        )
    plan = []
    for name in names:
        spec = deployment_spec(name, path, specs)
        schedules = spec.get("schedules") or [{}]
        if not (cron or schedules[0].get("cron")):
            raise InputError(f"{path}: deployment {name!r} has no cron schedule; give one with --cron")
        plan.append(
            {
                "name": name,
                "cron": cron or schedules[0]["cron"],
                "timezone": schedules[0].get("timezone", "UTC"),
                "parameters": {**spec.get("parameters", {}), **given},
                "description": spec.get("description"),
                "tags": spec.get("tags"),
            }
        )
    return plan


def runner_deployments(plan: list[dict]) -> list:
    """The plan as Prefect runner deployments of the `update` flow (schedule with its timezone)."""
    from prefect.schedules import Cron

    from .update import update

    return [
        update.to_deployment(
            name=d["name"],
            schedule=Cron(d["cron"], timezone=d["timezone"]),
            parameters=d["parameters"],
            description=d["description"],
            tags=d["tags"],
        )
        for d in plan
    ]


def serve_update(plan: list[dict]) -> None:
    """Serve every deployment of the plan from this process (one `prefect.serve`); Ctrl-C stops."""
    from prefect import serve

    deployments = runner_deployments(plan)
    for d in plan:
        print(
            f"serving deployment update/{d['name']}: cron '{d['cron']}' ({d['timezone']}), parameters {d['parameters']}"
        )
    serve(*deployments)


def prefect_status(limit: int = 5) -> str:
    """Last `update` flow runs and the next scheduled one: from the Prefect server when
    PREFECT_API_URL is set, else read in this process from the local database (what `atlas status
    --prefect` does in local mode; plain `atlas status` reads nothing then: the imports take seconds)."""
    from prefect.settings import PREFECT_API_URL

    scheduled, recent = _update_runs_from_server(limit) if PREFECT_API_URL.value() else _update_runs_local(limit)
    lines = ["Prefect (flow 'update'):"]
    if scheduled:
        when = scheduled[0].expected_start_time
        lines.append(f"  next scheduled run: {when:%Y-%m-%d %H:%M %Z} ({_from_now(when)})")
    else:
        lines.append("  next scheduled run: none (serve with `atlas serve`, or deploy deploy/prefect.yaml)")
    for r in recent:
        start = f"{r.start_time:%Y-%m-%d %H:%M:%S}" if r.start_time else "not started"
        lines.append(f"  {start}  {r.name:24s} {r.state_name}")
    return "\n".join(lines)


def _update_runs_from_server(limit: int) -> tuple[list, list]:
    """(the next scheduled run, the last `limit` other runs) of flow 'update', through the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas import filters
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    flows, states = _update_filters(filters, StateType)
    with get_client(sync_client=True) as client:
        scheduled = client.read_flow_runs(
            flow_filter=flows, flow_run_filter=states[0], sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1
        )
        recent = client.read_flow_runs(
            flow_filter=flows, flow_run_filter=states[1], sort=FlowRunSort.START_TIME_DESC, limit=limit
        )
    return scheduled, recent


def _update_runs_local(limit: int) -> tuple[list, list]:
    """The same from the local-mode database, read with Prefect's own server models. Prefect's
    client would first start a temporary server (11.6 s measured; it times out when another job
    holds the cores). No database yet means no runs; an older one is migrated, as a server would."""
    import asyncio

    from prefect.server.database import provide_database_interface
    from prefect.server.models.flow_runs import read_flow_runs
    from prefect.server.schemas import filters
    from prefect.server.schemas.sorting import FlowRunSort
    from prefect.server.schemas.states import StateType

    db = provide_database_interface()
    if db.database_config.connection_url.startswith("sqlite") and not _sqlite_file(db).is_file():
        return [], []
    flows, states = _update_filters(filters, StateType)

    async def read() -> tuple[list, list]:
        await db.create_db()  # brings an older local database to this Prefect's schema (no-op when current)
        async with db.session_context() as session:
            scheduled = await read_flow_runs(
                session, flow_filter=flows, flow_run_filter=states[0], sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1
            )
            recent = await read_flow_runs(
                session, flow_filter=flows, flow_run_filter=states[1], sort=FlowRunSort.START_TIME_DESC, limit=limit
            )
        await (await db.engine()).dispose()
        return list(scheduled), list(recent)

    return asyncio.run(read())


def _update_filters(filters, state_type) -> tuple:
    """Flow 'update'; (scheduled runs, every other run), for the client's or the server's schemas."""

    def by_state(**which):
        return filters.FlowRunFilter(state=filters.FlowRunFilterState(type=filters.FlowRunFilterStateType(**which)))

    return (
        filters.FlowFilter(name=filters.FlowFilterName(any_=[FLOW])),
        (by_state(any_=[state_type.SCHEDULED]), by_state(not_any_=[state_type.SCHEDULED])),
    )


def _sqlite_file(db) -> Path:
    from sqlalchemy.engine import make_url

    return Path(make_url(db.database_config.connection_url).database or "")


def _from_now(when: datetime) -> str:
    minutes = (when - datetime.now(timezone.utc)).total_seconds() / 60
    return f"in {minutes / 60:.1f} h" if minutes > 90 else f"in {minutes:.0f} min"
