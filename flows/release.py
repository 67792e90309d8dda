"""gate, promote and rollback.

`gate` runs the policy's checks on every candidate, records each decision with every
threshold, measured value and verdict, and selects among the passing ones. `promote`
publishes the selected version to MLflow and moves `champion` in one ledger transaction
(refused if another cycle moved it since the gate measured against it). `rollback` moves
`champion` back to the previous holder with a recorded reason (flows/cli_ops.py: rollback_champion,
which `atlas rollback` calls without a flow run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evaluation.timing import phase
from registry import GateCheckRecord, ReleaseInfo

from .cycle import CycleContext
from .gates import passed, run_checks, select
from .metrics import CandidateMetrics
from .platform import PlatformRef
from .resources import scope
from .retries import transient_only


@dataclass(frozen=True)
class GateOutcome:
    """The gate's result: every candidate's checks and recorded decision, and the one selected."""

    checks: dict[int, list[GateCheckRecord]] = field(default_factory=dict)  # version id -> checks
    decisions: dict[int, int] = field(default_factory=dict)  # version id -> gate decision id
    selected: Optional[CandidateMetrics] = None

    def verdict(self, version_id: int) -> bool:
        return passed(self.checks.get(version_id, []))


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def record_decision(ctx: CycleContext, m: CandidateMetrics, checks: list[GateCheckRecord]) -> int:
    """Record the verdict, unless this exact decision (evaluation, champion, policy) is already recorded."""
    with scope(ctx.platform) as res:
        return _record_decision(res.ledger, ctx, m, checks)


def _record_decision(db, ctx: CycleContext, m: CandidateMetrics, checks: list[GateCheckRecord]) -> int:
    from registry import latest_gate_decision, record_gate_decision

    last, policy = latest_gate_decision(db, m.version_id), ctx.policy
    if (
        last is not None
        and last.evaluation_id == m.evaluation_id
        and last.release_version_id == ctx.champion_id
        and last.policy_name == policy.label
        and last.evaluation_id is not None
        and [(c.name, c.passed) for c in last.checks] == [(c.name, c.passed) for c in checks]  # not when others failed
    ):
        return last.id
    info = record_gate_decision(
        db,
        m.version_id,
        policy.label,
        policy.to_dict() | {"hash": policy.hash},
        checks,
        evaluation_id=m.evaluation_id,
        release_version_id=ctx.champion_id,
        flow_run_id=ctx.flow_run_id,
    )
    return info.id


@task(cache_policy=NO_CACHE, retries=3, retry_delay_seconds=3, retry_condition_fn=transient_only)
def publish(platform: PlatformRef, version_id: int) -> str:
    """The version as an MLflow pyfunc model version (created once) with its current gate verdict as tags."""
    from registry import publish_version, sync_version_tags

    from .pyfunc import pyfunc_model

    with scope(platform) as res, phase("publish (MLflow model versions)"):
        p = res.platform
        number = publish_version(p.ledger, p.store, p.bridge, version_id, pyfunc_model())
        sync_version_tags(p.ledger, p.bridge, version_id)
    return number


@flow(name="gate", validate_parameters=True)
def gate(
    ctx: CycleContext, candidates: list[CandidateMetrics], failed: Optional[dict[str, str]] = None, total: int = 0
) -> GateOutcome:
    """Check every candidate against the policy (fail closed), record each decision, select one;
    decisions are measured against `ctx.champion` (the base while nobody holds `champion`).
    `failed`: the cycle's candidates (method and seed) that did not finish, and why, of `total`."""
    log = get_run_logger()
    checks, decisions = {}, {}
    for m in candidates:
        checks[m.version_id] = run_checks(m, ctx.policy, ctx.config.domain_names, failed, total)
        decisions[m.version_id] = record_decision(ctx, m, checks[m.version_id])
        rejected_by = [c.name for c in checks[m.version_id] if not c.passed]
        log.info(f"{m.name}: {'PASS' if not rejected_by else 'REJECT (' + ', '.join(rejected_by) + ')'}")
        publish(ctx.platform, m.version_id)
    selected = select(candidates, {v: passed(c) for v, c in checks.items()}, ctx.policy)
    return GateOutcome(checks, decisions, selected)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def move_champion(platform: PlatformRef, version_id: int, reason: str, flow_run_id: Optional[str]) -> ReleaseInfo:
    from registry import promote as registry_promote

    with scope(platform) as res:
        p = res.platform
        return registry_promote(p.ledger, p.bridge, version_id, reason=reason, flow_run_id=flow_run_id)


@flow(name="promote", validate_parameters=True)
def promote(
    platform: PlatformRef, version_id: int, reason: str, flow_run_id: Optional[str] = None
) -> Optional[ReleaseInfo]:
    """Make a gated version the champion; a lost race is reported, not raised (the other cycle won)."""
    from registry import PromotionConflict

    publish(platform, version_id)
    try:
        return move_champion(platform, version_id, reason, flow_run_id)
    except PromotionConflict as e:
        get_run_logger().warning(f"not promoted: {e}")
        return None


@flow(name="rollback", validate_parameters=False)
def rollback(model: str, reason: str):
    """Move `champion` of a registered model (name or ledger id) back to its previous holder: the
    deployments' way; `atlas rollback` calls the same plain function without a flow run."""
    from .cli_ops import rollback_champion
    from .platform import open_platform

    p = open_platform()
    try:
        done = rollback_champion(p, model, reason, flow_run_id=_flow_run_id())
        get_run_logger().info(f"{done.model}: champion is now {done.champion}")
        return done.release
    finally:
        p.close()


def _flow_run_id() -> Optional[str]:
    from prefect.runtime import flow_run

    return flow_run.id
