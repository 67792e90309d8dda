"""What Prefect knows of the `update` flow's runs: the next scheduled one and the last ones.

Read from a Prefect server when PREFECT_API_URL is set, else from Prefect's local database under the
state folder, in this process (no temporary server: `atlas status --prefect` in local mode).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

FLOW = "update"  # the cycle's flow (flows/update.py), whatever its deployments are called


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
