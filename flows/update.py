"""update: the whole scheduled cycle, for one skill on one line.

    resolve_lineage -> (idle?) -> refresh_atlas -> (idle?) -> run_candidates (each: train + evaluate,
        here or on a work pool) -> gate -> promote -> publish_report

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

from dataclasses import replace
from typing import Optional

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from atlas_core.errors import InputError
from evaluation.timing import take as take_steps
from registry import alias_holder

from .candidates import require_work_pool, run_candidates
from .config import UpdateConfig
from .cycle import CycleContext, CycleResult, load_cycle
from .evaluate import eval_key, record_base
from .lineage import already_gated, resolve_lineage, taught_by_chain
from .platform import DEFAULT_CONFIG, DEFAULT_POLICY, PlatformRef, subflows_without_heartbeats
from .policy import ReleasePolicy
from .publish import PhaseClock, publish_report
from .refresh import refresh_atlas
from .release import gate, promote
from .resources import Resources, scope
from .skills import skill_set
from .training import planned_runs


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


def idle_result(ctx: CycleContext, reason: str) -> CycleResult:
    champion = ctx.champion.version.name
    get_run_logger().info(f"idle: {reason}")
    return CycleResult(
        model=ctx.model.name,
        outcome="idle",
        champion=champion,
        previous_champion=champion,
        state=ctx.platform.state,
        reason=reason,
    )


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
    with scope(platform), subflows_without_heartbeats():
        clock = PhaseClock()
        take_steps()  # the step table starts with this cycle
        ctx = resolve_lineage(config, policy, platform, flow_run.id)
        clock.lap("lineage (backbone, ledger, champion chain)")
        return run_cycle(ctx, clock)


def run_cycle(ctx: CycleContext, clock: Optional[PhaseClock] = None) -> CycleResult:
    """The stages after resolve_lineage, each taking and returning plain values; `clock` has
    already timed resolve_lineage (backbone load, ledger, champion chain)."""
    with scope(ctx.platform) as res, subflows_without_heartbeats():
        return _run_stages(res, ctx, clock or PhaseClock())


def _run_stages(res: Resources, ctx: CycleContext, clock: PhaseClock) -> CycleResult:
    data = skill_set(ctx.skill)
    taught = taught_by_chain(res.ledger, ctx, data.sha256)
    if taught is not None:
        return idle_result(
            ctx,
            f"skill {ctx.skill.name!r} snapshot {data.sha256[:12]} is already released "
            f"in the champion's chain ({taught}); nothing new to train",
        )
    require_work_pool(ctx.config.execution)
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
    runs = run_candidates(ctx, clock.lap)
    candidates = [m for run in runs for m in run.metrics]
    failed = {run.label: run.failure for run in runs if run.failure is not None}
    record_base(ctx)
    clock.lap("evaluate base")
    outcome = gate(ctx, candidates, failed, len(runs))
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
    report = publish_report(ctx, candidates, outcome, release, clock.phases, steps, failed)
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
        failed=failed,
        report=report,
        seconds=dict(clock.phases),
        steps=steps,
    )
