"""publish_report: the cycle's report written (flows/report.py) and published as a Prefect artifact and
as an MLflow run; and the clock whose phases its "Where the time went" table shows.
"""

from __future__ import annotations

import time
from typing import Optional

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from registry import ReleaseInfo

from .cycle import CycleContext
from .metrics import CandidateMetrics
from .release import GateOutcome
from .resources import scope
from .retries import transient_only


def phase_key(name: str) -> str:
    """A phase name as an MLflow metric key ('evaluate smollm2-...-e2' -> 'evaluate_smollm2-...-e2')."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


class PhaseClock:
    """Wall seconds per phase of one cycle, in the order the phases ran."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now


def outcome_text(ctx: CycleContext, outcome: GateOutcome, release, candidates: list[CandidateMetrics]) -> str:
    champion = ctx.champion.version
    if not candidates:
        return f"No candidates to gate (every one is retired); the champion stays **{champion.name}**."
    if release is not None:
        s = outcome.selected
        return (
            f"**PROMOTED {s.name}** (was {champion.name}): passed every check of policy `{ctx.policy.label}`; "
            f"target {s.target_score:g} (champion {s.champion_score:g}); lowest retained KL among "
            f"{sum(outcome.verdict(c.version_id) for c in candidates)} passing candidate(s)."
        )
    if outcome.selected is not None:
        return (
            f"**NOT PROMOTED**: {outcome.selected.name} passed, but another cycle moved `champion` since it was "
            f"measured; the champion stays as recorded in the ledger."
        )
    reasons = [
        f"- {c.name}: failed " + ", ".join(ch.name for ch in outcome.checks[c.version_id] if not ch.passed)
        for c in candidates
    ]
    return (
        f"**REJECTED**: no candidate passed policy `{ctx.policy.label}`; the champion stays **{champion.name}**.\n\n"
        + "\n".join(reasons)
    )


def line_after(p, model_id: int, promoted: bool):
    """The line's history after this cycle (None while only the base serves); a promotion also
    logs the newest row (R[T][i], OP, BWT, KL vs base) on the promoted version's MLflow run.
    `p`: the opened flows.platform.Platform."""
    from registry import alias_holder, ensure_mlflow_run

    from .history import line_history

    champion = alias_holder(p.ledger, model_id)
    if champion is None:
        return None
    history = line_history(p.ledger, model_id, champion.id)
    if promoted:
        run_id = ensure_mlflow_run(p.ledger, p.bridge, champion.training_run_id)
        p.bridge.log_metrics(run_id, history.metrics(), champion.step)
    return history


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3, retry_condition_fn=transient_only)
def publish_report(
    ctx: CycleContext,
    candidates: list[CandidateMetrics],
    outcome: GateOutcome,
    release: Optional[ReleaseInfo],
    phases: dict[str, float],
    steps: dict[str, float],
    failed: Optional[dict[str, str]] = None,
) -> str:
    """Write the report, then publish it as a Prefect artifact and as an MLflow run's artifacts;
    `failed`: candidates (method and seed) that did not finish, and why."""
    with scope(ctx.platform) as res:
        return _write_and_publish(res.platform, ctx, candidates, outcome, release, phases, steps, failed or {})


def _write_and_publish(p, ctx: CycleContext, candidates, outcome: GateOutcome, release, phases, steps, failed) -> str:
    from .compare import compare_versions
    from .report import report_folder, write_report

    model, champion = ctx.model, ctx.champion.version
    folder = report_folder(p.state, model.name, ctx.flow_run_id)
    best = outcome.selected or (
        max(candidates, key=lambda c: (c.target_solved or 0, -c.mean_kl("kl_vs_champion"))) if candidates else None
    )
    comparison = compare_versions(p.ledger, champion.id, best.version_id).to_markdown() if best else None
    header = {
        "model": model.name,
        "flow run": ctx.flow_run_id or "-",
        "config": ctx.config.name,
        "policy": ctx.policy.label,
        "backbone": f"{ctx.backbone.name} @ {ctx.backbone.revision[:16]}",
        "layer": ctx.layer,
        "champion before": champion.name,
    }
    if failed:
        header["failed candidates"] = "; ".join(f"{name} ({why})" for name, why in failed.items())
    where = [
        f"MLflow UI: `.venv/bin/mlflow ui --backend-store-uri {p.bridge.config.tracking_uri}` "
        f"(experiment '{model.backbone} / {model.line}', registered model '{model.name}')",
        f"History: `atlas history --model {model.name}`",
        f"Explain a verdict: `atlas gate --explain VERSION --model {model.name}`",
    ]
    text = outcome_text(ctx, outcome, release, candidates)
    history = line_after(p, model.id, release is not None)
    path = write_report(folder, header, text, candidates, outcome, comparison, where, history, phases, steps)
    create_markdown_artifact(key="update-report", markdown=path.read_text(), description=f"{model.name}: {text[:200]}")
    run_id = p.bridge.start_run(
        model.backbone,
        model.line,
        f"update-cycle-{folder.name}",
        {"policy": ctx.policy.label, "config": ctx.config.name, "flow_run_id": ctx.flow_run_id or "-"},
        tags={"kind": "update-cycle"},
    )
    p.bridge.log_folder(run_id, folder, "report")
    p.bridge.log_metrics(
        run_id,
        {f"seconds/{phase_key(k)}": v for k, v in phases.items()}
        | {f"seconds/step/{phase_key(k)}": v for k, v in steps.items()},
        0,
    )
    p.bridge.end_run(run_id)
    return str(path)
