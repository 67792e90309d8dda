"""Serving the `update` deployment from one process (what Prefect knows of its runs: flows/prefect_runs.py).

`serving_plan` reads deployments of deploy/prefect.yaml (schedule, event triggers, parameters; by
default every scheduled one, e.g. one per line or skill) and `serve_update` serves them all from one
process with `prefect.serve`: it registers the deployments and runs each scheduled (or
manually triggered) cycle itself; no work pool or worker is needed. Without
PREFECT_API_URL, Prefect runs in local mode with its database under the state folder.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from atlas_core.errors import InputError
from atlas_core.paths import PROJECT_ROOT

PREFECT_FILE = PROJECT_ROOT / "deploy" / "prefect.yaml"
DEPLOYMENT = "update"


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
        triggers = spec.get("triggers") or []
        if not (cron or schedules[0].get("cron") or triggers):
            raise InputError(f"{path}: deployment {name!r} has no cron schedule and no trigger; give one with --cron")
        plan.append(
            {
                "name": name,
                "cron": cron or schedules[0].get("cron"),
                "timezone": schedules[0].get("timezone", "UTC"),
                "parameters": {**spec.get("parameters", {}), **given},
                "description": spec.get("description"),
                "tags": spec.get("tags"),
                "triggers": triggers,
            }
        )
    return plan


def deployment_triggers(specs: list[dict], where: str) -> list:
    """deploy/prefect.yaml's `triggers:` entries as Prefect deployment triggers (validated)."""
    from prefect.events.schemas.deployment_triggers import DeploymentTriggerTypes
    from pydantic import TypeAdapter, ValidationError

    out = []
    for i, spec in enumerate(specs):
        try:
            out.append(TypeAdapter(DeploymentTriggerTypes).validate_python(spec))
        except ValidationError as e:
            raise InputError(f"{where}.triggers[{i}]: {' '.join(str(e).split())}") from None
    return out


def runner_deployments(plan: list[dict]) -> list:
    """The plan as Prefect runner deployments of the `update` flow (schedule with its timezone)."""
    from prefect.schedules import Cron

    from .update import update

    return [
        update.to_deployment(
            name=d["name"],
            schedule=Cron(d["cron"], timezone=d["timezone"]) if d["cron"] else None,
            parameters=d["parameters"],
            description=d["description"],
            tags=d["tags"],
            triggers=deployment_triggers(d.get("triggers", []), f"deployment {d['name']}"),
        )
        for d in plan
    ]


def serve_update(plan: list[dict]) -> None:
    """Serve every deployment of the plan from this process (one `prefect.serve`); Ctrl-C stops."""
    from prefect import serve

    deployments = runner_deployments(plan)
    for d in plan:
        when = f"cron '{d['cron']}' ({d['timezone']})" if d["cron"] else "no schedule"
        events = [t.get("expect") for t in d.get("triggers", [])]
        print(
            f"serving deployment update/{d['name']}: {when}, triggers {events or 'none'}, parameters {d['parameters']}"
        )
    serve(*deployments)
