"""update: the whole scheduled cycle, for one skill on one line.

    resolve_lineage -> (idle?) -> refresh_atlas -> (idle?) -> train_skill -> evaluate_candidate (each)
        -> gate -> promote -> publish_report

Each stage takes and returns plain typed values (flows/cycle.py: CycleContext, AtlasRef,
CandidateMetrics, GateOutcome, ReleaseInfo) and is a Prefect flow or task of its own, so its
parameters are validated and its result can be persisted; the loaded backbone and caches are
process resources (flows/runtime.py) that live for one `update` call.

Each release builds on the line's champion: candidates train one delta with the champion's
chain attached, the atlas describes the champion's activations, and every skill released
before (other than the one taught now) is a retained domain of the gates. A cycle with
nothing new (the skill's snapshot already in the champion's chain, or every candidate
already gated against this champion) ends early as `idle` and writes nothing.

Run it with `atlas update`, from a deployment (deploy/prefect.yaml), or from Python:
`update(config="configs/update/default.yaml", policy="configs/policy/default.yaml")`.
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

from .platform import DEFAULT_CONFIG, DEFAULT_POLICY, configure_environment

configure_environment()

from registry import ModelInfo, ReleaseInfo, VersionInfo  # noqa: E402 (after the environment is set)

from .config import UpdateConfig  # noqa: E402
from .cycle import CycleContext  # noqa: E402
from .gates import CandidateMetrics  # noqa: E402
from .policy import ReleasePolicy  # noqa: E402
from .release import GateOutcome  # noqa: E402
from .retries import transient_only  # noqa: E402


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=transient_only)
def load_backbone_task(name: str, dtype: str) -> tuple[str, str, int, str]:
    """Load the backbone (first use converts the shipped GGUF; transient errors are retried);
    returns (revision, resolved dtype, number of decoder layers, weights sha256)."""
    from atlas_core.backbone import weights_sha256

    from .runtime import load_backbone

    bb = load_backbone(name, dtype)
    return bb.revision, bb.dtype, bb.num_layers, weights_sha256(bb.model)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def record_lineage(
    name: str, revision: str, weights: str, line: str
) -> tuple[int, ModelInfo, VersionInfo, VersionInfo]:
    """Backbone, line and its base version in the ledger (get-or-create), and the champion's holder
    (the base while nobody holds it): (backbone id, line, base, champion)."""
    from registry import alias_holder, base_version, ensure_backbone, ensure_model

    from .runtime import ledger

    backbone_id = ensure_backbone(ledger(), name, revision, weights)
    model = ensure_model(ledger(), backbone_id, line)
    base = base_version(ledger(), model.id)
    return backbone_id, model, base, alias_holder(ledger(), model.id) or base


@flow(name="resolve_lineage", validate_parameters=True)
def resolve_lineage(config: UpdateConfig, policy: ReleasePolicy, flow_run_id: Optional[str] = None) -> CycleContext:
    """The cycle's context: backbone, line, base, the champion with its whole chain loaded and
    verified, the skill taught now and the released skills it must keep, their scorers and the
    policy's thresholds for them validated before anything trains."""
    from .cycle import Applied, BackboneRef
    from .gates import regression_kind
    from .lineage import chain_skill_specs
    from .policy import PASS_FAIL
    from .runtime import ledger, platform, resolve_applied, scorer
    from .skills import SkillSpec, released_skills, require_evaluable

    revision, dtype, layers, weights = load_backbone_task(config.backbone, config.dtype)
    backbone_id, model, base, holder = record_lineage(config.backbone, revision, weights, config.line_name)
    layer = layers // 2 if config.layer == -1 else config.layer
    champion = resolve_applied(holder)
    skill = SkillSpec.from_config(config)
    kept = chain_skill_specs(ledger(), champion, platform().store, platform().state / "cache" / "snapshots")
    released = released_skills(kept, skill.name)
    # Everything a cycle will read of each skill, resolved before anything trains: its files, both
    # sides of its pairs (the one taught now is a released skill of every later cycle) and its scorer.
    require_evaluable(skill, "target")
    for spec in released:
        require_evaluable(spec, "released")
    for spec in (skill, *released):
        scorer(spec)
    policy.require_released([s.name for s in released])
    # Thresholds no outcome could meet at these problem counts are refused now, not after training.
    target = scorer(skill)
    policy.require_feasible_target(len(target.problem_ids()), regression_kind(target) == PASS_FAIL)
    policy.require_feasible_released(
        {s.name: (regression_kind(scorer(s)), len(scorer(s).problem_ids())) for s in released}
    )
    return CycleContext(
        config,
        policy,
        BackboneRef(config.backbone, revision, dtype, backbone_id, layer),
        model,
        Applied(base),
        champion,
        skill,
        tuple(released),
        flow_run_id=flow_run_id,
    )


def needed_atlas_variants(ctx: CycleContext) -> list[str]:
    from atlas_core.residual import RESIDUAL_VARIANTS
    from atlas_core.train import load_run_config

    from .config import resolve

    variants = []
    for method in ctx.policy.candidates.methods:
        path = resolve(f"{ctx.config.train.configs_dir}/{method}.yaml")
        if not path.is_file():
            raise InputError(f"candidates.methods: no run config {path} for method {method!r}")
        adapter = load_run_config(path).adapter
        variant = None if adapter == "weight-lora" else RESIDUAL_VARIANTS[adapter]
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


def line_after(model_id: int, promoted: bool):
    """The line's history after this cycle (None while only the base serves); a promotion also
    logs the newest row (R[T][i], OP, BWT, KL vs base) on the promoted version's MLflow run."""
    from registry import alias_holder, ensure_mlflow_run

    from .history import line_history
    from .runtime import platform

    p = platform()
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
    from registry import compare_versions

    from .report import report_folder, write_report
    from .runtime import platform

    p, model, champion = platform(), ctx.model, ctx.champion.version
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
    history = line_after(model.id, release is not None)
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


def idle_result(ctx: CycleContext, reason: str) -> dict:
    from .runtime import platform

    champion = ctx.champion.version
    get_run_logger().info(f"idle: {reason}")
    return {
        "model": ctx.model.name,
        "outcome": "idle",
        "promoted": False,
        "champion": champion.name,
        "previous_champion": champion.name,
        "selected": None,
        "candidates": {},
        "report": None,
        "reason": reason,
        "state": str(platform().state),
    }


@flow(name="update", validate_parameters=True)
def update(
    config: str = DEFAULT_CONFIG,
    policy: str = DEFAULT_POLICY,
    backbone: Optional[str] = None,
    skill: Optional[str] = None,
    snapshot: Optional[str] = None,
    line: Optional[str] = None,
) -> dict:
    """One update cycle on a line: refresh the atlas on the champion, train the policy's candidates
    on top of it, evaluate them on everything the line keeps, gate, promote, report.

    `snapshot`: the skill's training data (a JSONL file, or a folder whose newest snapshot is taken);
    given, it replaces the config's `data.source`. `backbone`, `skill`, `line`: given, they replace the
    config's fields. Outcome: promoted | rejected | not-promoted (lost a race) | idle."""
    from prefect.runtime import flow_run

    from evaluation.timing import take as take_steps

    from .config import load_update_config
    from .policy import load_cycle_policy
    from .runtime import session

    cfg = load_update_config(config, backbone=backbone, skill=skill, line=line)
    if snapshot is not None:
        cfg = with_snapshot(cfg, snapshot)
    with session():
        clock = _Clock()
        take_steps()  # the step table starts with this cycle
        ctx = resolve_lineage(cfg, load_cycle_policy(policy, cfg), flow_run.id)
        clock.lap("lineage (backbone, ledger, champion chain)")
        return run_cycle(ctx, clock)


def with_snapshot(cfg: UpdateConfig, snapshot: str) -> UpdateConfig:
    """The config with `--snapshot` as its data source (validated as data.source is)."""
    from atlas_core.typed_config import ConfigError

    try:
        return replace(cfg, data=replace(cfg.data, source=snapshot))
    except ConfigError as e:
        raise ConfigError(f"--snapshot: {str(e).removeprefix('source: ')}") from None


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


def run_cycle(ctx: CycleContext, clock: Optional[_Clock] = None) -> dict:
    """The stages after resolve_lineage, each taking and returning plain values; `clock` has
    already timed resolve_lineage (backbone load, ledger, champion chain)."""
    from evaluation.timing import take as take_steps
    from registry import alias_holder

    from .evaluate import eval_key, evaluate_candidate, record_base
    from .lineage import already_gated, taught_by_chain
    from .refresh import refresh_atlas
    from .release import gate, promote
    from .runtime import ledger, platform
    from .skills import skill_set
    from .training import planned_runs, train_skill

    data = skill_set(ctx.skill)
    taught = taught_by_chain(ctx, data.sha256)
    if taught is not None:
        return idle_result(
            ctx,
            f"skill {ctx.skill.name!r} snapshot {data.sha256[:12]} is already released "
            f"in the champion's chain ({taught}); nothing new to train",
        )
    clock = clock or _Clock()
    atlases = []
    for variant in needed_atlas_variants(ctx):
        atlases.append(refresh_atlas(ctx, variant))
        clock.lap(f"atlas {variant}")
    ctx = replace(ctx, atlases=tuple(atlases))
    if already_gated(ctx, [(m, s, k) for m, s, _, _, k in planned_runs(ctx, data)], eval_key(ctx)):
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
            s.version_id,
            f"gate {ctx.policy.label} passed; {ctx.skill.name} {s.target_score:g} "
            f"(champion {s.champion_score:g}) on top of {champion.name}; lowest retained KL",
            ctx.flow_run_id,
        )
        clock.lap("promote")
    steps = take_steps()
    report = publish_report(ctx, candidates, outcome, release, clock.phases, steps)
    get_run_logger().info(f"report: {report}")
    new_champion = alias_holder(ledger(), ctx.model.id) or ctx.base.version
    result = "promoted" if release is not None else "not-promoted" if outcome.selected is not None else "rejected"
    return {
        "model": ctx.model.name,
        "outcome": result,
        "promoted": release is not None,
        "champion": new_champion.name,
        "previous_champion": champion.name,
        "selected": outcome.selected.name if outcome.selected else None,
        "candidates": {c.name: outcome.verdict(c.version_id) for c in candidates},
        "report": report,
        "seconds": dict(clock.phases),
        "steps": steps,
        "state": str(platform().state),
    }
