"""gate_candidate: the release gate for a version nobody trained in this cycle (e.g. `atlas submit`).

    atlas gate check VERSION --config C --policy P [--json] [--promote]
    prefect deployment run 'gate-candidate/gate-candidate' -p version=... -p config=... -p policy=...

The same stages as an update cycle without training (flows/update.py):

    resolve_lineage(config, policy) -> evaluate_candidate(version) -> gate -> [promote] -> publish_report

so a submitted adapter is measured exactly as a trained candidate: the config's target skill
against the champion, every released skill's no-regression, retained KL vs the champion and
the base on every retained member, NFR and choice churn; the decision is recorded in the
ledger and on the MLflow version. The version must teach the config's skill; when it passes, the
skill's spec is stored on the version's run, so later cycles keep it as a released skill.
A submitted delta may change any layer, so the KL prefix cache ends below its lowest one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

from prefect import flow

from atlas_core.errors import InputError
from registry import GateCheckRecord

from .platform import DEFAULT_CONFIG, DEFAULT_POLICY, PlatformRef


@dataclass(frozen=True)
class GateCheckResult:
    model: str
    version: str
    passed: bool
    promoted: bool
    against: str  # the champion it was measured against
    champion: str  # the champion after the check
    policy: str
    decision_id: int
    checks: tuple[GateCheckRecord, ...]
    report: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self) | {"checks": [asdict(c) for c in self.checks]}


def candidate_version(ledger, model_id: int, ref: str, skill: str):
    """The version `ref` of a line, checked: not the base nor the champion, active, and teaching
    `skill` (the config's). Reads the ledger only, so the CLI checks it before Prefect starts."""
    from registry import alias_holder, resolve_version

    v = resolve_version(ledger, model_id, ref)
    holder = alias_holder(ledger, model_id)
    if v.is_base or (holder is not None and v.id == holder.id):
        raise InputError(
            f"version {ref!r}: {v.name} is the {'base' if v.is_base else 'champion'}; "
            "gate a candidate (`atlas submit` prints its name)"
        )
    if v.status == "retired":
        raise InputError(f"version {ref!r}: {v.name} was rolled back (retired); `atlas renominate` it first")
    if v.skill != skill:
        raise InputError(
            f"version {ref!r}: {v.name} teaches skill {v.skill!r}, the config's skill is "
            f"{skill!r} (atlas submit --skill, or the config's `skill`)"
        )
    return v


@flow(name="gate-candidate", validate_parameters=True)
def gate_candidate(
    version: str,
    config: str = DEFAULT_CONFIG,
    policy: str = DEFAULT_POLICY,
    line: Optional[str] = None,
    promote: bool = False,
) -> GateCheckResult:
    """Gate one existing candidate version against the champion with a policy; with `promote`, a
    passing version becomes the champion."""
    from prefect.runtime import flow_run

    from registry import alias_holder, complete_run_config, training_run_config

    from .config import load_update_config
    from .evaluate import evaluate_candidate, record_base
    from .lineage import resolve_lineage
    from .platform import subflows_without_heartbeats
    from .policy import load_cycle_policy
    from .publish import PhaseClock, publish_report
    from .release import gate
    from .release import promote as promote_flow
    from .resources import scope

    cfg, platform = load_update_config(config, line=line), PlatformRef.from_environment()
    with scope(platform) as res, subflows_without_heartbeats():
        db, clock = res.ledger, PhaseClock()
        ctx = resolve_lineage(cfg, load_cycle_policy(policy, cfg), platform, flow_run.id)
        v = candidate_version(db, ctx.model.id, version, ctx.skill.name)
        ctx = replace(ctx, lowest_candidate_layer=res.resolve_applied(v).lowest_layer)
        clock.lap("lineage (backbone, ledger, champion chain)")
        m = evaluate_candidate(ctx, v.id)
        record_base(ctx)
        clock.lap(f"evaluate {v.name}")
        outcome = gate(ctx, [m])
        if outcome.verdict(v.id) and "skill" not in training_run_config(db, v.training_run_id):
            # a submitted run: the skill spec it passed with, which later cycles keep as released
            complete_run_config(db, v.training_run_id, "skill", ctx.skill.to_dict())
        release = None
        if promote and outcome.selected is not None:
            release = promote_flow(
                platform,
                v.id,
                f"gate {ctx.policy.label} passed (atlas gate check) on top of {ctx.champion.version.name}",
                ctx.flow_run_id,
            )
        report = publish_report(ctx, [m], outcome, release, clock.phases, {})
        champion = alias_holder(db, ctx.model.id) or ctx.base.version
        return GateCheckResult(
            ctx.model.name,
            v.name,
            outcome.verdict(v.id),
            release is not None,
            ctx.champion.version.name,
            champion.name,
            ctx.policy.label,
            outcome.decisions[v.id],
            tuple(outcome.checks[v.id]),
            report,
        )
