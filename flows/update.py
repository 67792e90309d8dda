"""update: the whole scheduled cycle, for one skill on one line.

    resolve_lineage -> (idle?) -> refresh_atlas -> (idle?) -> train_skill -> evaluate_candidate (each)
        -> gate -> promote -> publish_report

Each stage takes and returns plain typed values (flows/cycle.py: CycleContext, AtlasRef,
CandidateMetrics, GateOutcome, ReleaseInfo) and is a Prefect flow or task of its own, so its
parameters are validated and its result can be persisted; the loaded backbone and caches live in
one flows.resources.Resources that `cycle` opens for the whole call and closes at its end. The
cycle returns a frozen CycleResult (flows/cycle.py), which `atlas update` renders.

Each release builds on the line's champion: candidates train one delta with the champion's
chain attached, the atlas describes the champion's activations, and every skill released
before (other than the one taught now) is a retained domain of the gates. A cycle with
nothing new (the skill's snapshot already in the champion's chain, or every candidate
already gated against this champion) ends early as `idle` and writes nothing.

Run it with `atlas update`, from a deployment (deploy/prefect.yaml), or from Python:
`update(config="configs/update/default.yaml", policy="configs/policy/default.yaml")` (call
flows.platform.configure_environment() first to keep Prefect's home under the state folder, as
`atlas` does).
Every stage is safe to rerun: a crashed cycle started again reuses the atlas, resumes
training, reuses stored answers and evaluations, and records nothing twice.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from atlas_core.errors import InputError
from registry import ReleaseInfo

from .config import UpdateConfig
from .cycle import CycleContext, CycleResult, load_cycle
from .lineage import resolve_lineage
from .metrics import CandidateMetrics
from .platform import DEFAULT_CONFIG, DEFAULT_POLICY, PlatformRef
from .policy import ReleasePolicy
from .release import GateOutcome
from .resources import Resources, scope
from .retries import transient_only


def needed_atlas_variants(ctx: CycleContext) -> list[str]:
    from atlas_core.methods import method_for
    from atlas_core.train import load_run_config

    from .config import resolve

    variants = []
    for method in ctx.policy.candidates.methods:
        path = resolve(f"{ctx.config.train.configs_dir}/{method}.yaml")
        if not path.is_file():
            raise InputError(f"candidates.methods: no run config {path} for method {method!r}")
        variant = method_for(load_run_config(path)).atlas_variant  # None: the method routes with no atlas
        if variant and variant not in variants:
            variants.append(variant)
    return variants


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
) -> str:
    """Write the report, then publish it as a Prefect artifact and as an MLflow run's artifacts."""
    with scope(ctx.platform) as res:
        return _write_and_publish(res.platform, ctx, candidates, outcome, release, phases, steps)


def _write_and_publish(p, ctx: CycleContext, candidates, outcome: GateOutcome, release, phases, steps) -> str:
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


def idle_result(ctx: CycleContext, reason: str) -> CycleResult:
    champion = ctx.champion.version.name
    get_run_logger().info(f"idle: {reason}")
    return CycleResult(ctx.model.name, "idle", champion, champion, ctx.platform.state, reason=reason)


@flow(name="update", validate_parameters=True)
def update(
    config: str = DEFAULT_CONFIG,
    policy: str = DEFAULT_POLICY,
    backbone: Optional[str] = None,
    skill: Optional[str] = None,
    snapshot: Optional[str] = None,
    line: Optional[str] = None,
) -> CycleResult:
    """One update cycle on a line: refresh the atlas on the champion, train the policy's candidates
    on top of it, evaluate them on everything the line keeps, gate, promote, report.

    `config`, `policy`: YAML files. `snapshot`: the skill's training data (a JSONL file, or a folder
    whose newest snapshot is taken); given, it replaces the config's `data.source`. `backbone`,
    `skill`, `line`: given, they replace the config's fields. The records go where the environment
    says (flows/platform.py). Outcome: promoted | rejected | not-promoted (lost a race) | idle."""
    cfg, pol = load_cycle(config, policy, backbone=backbone, skill=skill, line=line, snapshot=snapshot)
    return cycle(cfg, pol, PlatformRef.from_environment())


@flow(name="update", validate_parameters=True)
def update_parsed(config: UpdateConfig, policy: ReleasePolicy, platform: PlatformRef) -> CycleResult:
    """`update` for a config and policy already loaded (`atlas update` parses and checks them
    before Prefect starts, and they are not parsed again)."""
    return cycle(config, policy, platform)


def cycle(config: UpdateConfig, policy: ReleasePolicy, platform: PlatformRef) -> CycleResult:
    """The stages of one cycle, inside one resources scope (one backbone, one cache per member)."""
    from prefect.runtime import flow_run

    from evaluation.timing import take as take_steps

    with scope(platform):
        clock = _Clock()
        take_steps()  # the step table starts with this cycle
        ctx = resolve_lineage(config, policy, platform, flow_run.id)
        clock.lap("lineage (backbone, ledger, champion chain)")
        return run_cycle(ctx, clock)


def phase_key(name: str) -> str:
    """A phase name as an MLflow metric key ('evaluate smollm2-...-e2' -> 'evaluate_smollm2-...-e2')."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


class _Clock:
    """Wall seconds per phase of one cycle, in the order the phases ran."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now


def run_cycle(ctx: CycleContext, clock: Optional[_Clock] = None) -> CycleResult:
    """The stages after resolve_lineage, each taking and returning plain values; `clock` has
    already timed resolve_lineage (backbone load, ledger, champion chain)."""
    with scope(ctx.platform) as res:
        return _run_stages(res, ctx, clock or _Clock())


def _run_stages(res: Resources, ctx: CycleContext, clock: _Clock) -> CycleResult:
    from evaluation.timing import take as take_steps
    from registry import alias_holder

    from .evaluate import eval_key, evaluate_candidate, record_base
    from .lineage import already_gated, taught_by_chain
    from .refresh import refresh_atlas
    from .release import gate, promote
    from .skills import skill_set
    from .training import planned_runs, train_skill

    data = skill_set(ctx.skill)
    taught = taught_by_chain(res.ledger, ctx, data.sha256)
    if taught is not None:
        return idle_result(
            ctx,
            f"skill {ctx.skill.name!r} snapshot {data.sha256[:12]} is already released "
            f"in the champion's chain ({taught}); nothing new to train",
        )
    atlases = []
    for variant in needed_atlas_variants(ctx):
        atlases.append(refresh_atlas(ctx, variant))
        clock.lap(f"atlas {variant}")
    ctx = replace(ctx, atlases=tuple(atlases))
    if already_gated(res.ledger, ctx, [(m, s, k) for m, s, _, _, k in planned_runs(ctx, data)], eval_key(ctx)):
        return idle_result(
            ctx,
            f"every candidate of this snapshot was already gated against "
            f"{ctx.champion.version.name} with policy {ctx.policy.label}",
        )
    champion = ctx.champion.version
    versions = [v for v in train_skill(ctx) if v != champion.id]
    clock.lap("training")
    candidates = []
    for v in versions:
        candidates.append(evaluate_candidate(ctx, v))
        clock.lap(f"evaluate {candidates[-1].name}")  # champion and base answers are generated once, in the first
    record_base(ctx)
    clock.lap("evaluate base")
    outcome = gate(ctx, candidates)
    clock.lap("gate")
    release = None
    if outcome.selected is not None:
        s = outcome.selected
        release = promote(
            ctx.platform,
            s.version_id,
            f"gate {ctx.policy.label} passed; {ctx.skill.name} {s.target_score:g} "
            f"(champion {s.champion_score:g}) on top of {champion.name}; lowest retained KL",
            ctx.flow_run_id,
        )
        clock.lap("promote")
    steps = take_steps()
    report = publish_report(ctx, candidates, outcome, release, clock.phases, steps)
    get_run_logger().info(f"report: {report}")
    new_champion = alias_holder(res.ledger, ctx.model.id) or ctx.base.version
    result = "promoted" if release is not None else "not-promoted" if outcome.selected is not None else "rejected"
    return CycleResult(
        model=ctx.model.name,
        outcome=result,
        champion=new_champion.name,
        previous_champion=champion.name,
        state=ctx.platform.state,
        selected=outcome.selected.name if outcome.selected else None,
        candidates={c.name: outcome.verdict(c.version_id) for c in candidates},
        report=report,
        seconds=dict(clock.phases),
        steps=steps,
    )
