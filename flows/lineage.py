"""resolve_lineage, the cycle's first stage, and what a line's history says about the cycle at hand.

- `resolve_lineage(config, policy, platform)`: backbone, line, base, the champion with its whole
  chain loaded and verified, the skill taught now and the released skills it keeps, every skill
  and the policy's limits for them checked before anything trains -> flows.cycle.CycleContext;
- `chain_skill_specs`: the skill specs stored on the training runs of the champion's chain
  (what each release taught, so later cycles keep it);
- `taught_by_chain` / `already_gated`: why this cycle has nothing new to do. A cycle is idle when
  the snapshot it would teach is already taught by the champion's chain, or when every
  candidate it would train already exists, finished, and was gated against this champion
  with this policy and these evaluation settings (a rerun); rolled-back (retired) versions
  count as decided: no cycle promotes them again unless a person re-nominates them, after
  which the next cycle gates them again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from registry import ModelInfo, VersionInfo

from .config import UpdateConfig
from .cycle import Applied, CycleContext
from .platform import PlatformRef
from .policy import ReleasePolicy
from .resources import Resources, scope
from .retries import transient_only
from .skills import SkillSpec, pinned_spec


def chain_specs(ledger, champion: Applied) -> list[tuple[object, dict]]:
    """(version, its training run's stored config) for every delta of the champion's chain."""
    from registry import training_run_config

    return [(v, training_run_config(ledger, v.training_run_id)) for v in champion.deltas]


def taught_skills(ledger, applied: Applied) -> list[dict]:
    """{skill, skill_files} of every release in a version's chain, oldest first; a squash
    (flows/squash.py) stands for the releases it replaced."""
    runs = []
    for _, config in chain_specs(ledger, applied):
        for run in (*config.get("squashed", {}).get("skills", ()), config):
            if "skill" in run:
                runs.append({k: run[k] for k in ("skill", "skill_files") if k in run})
    return runs


def chain_skill_specs(ledger, champion: Applied, store=None, cache: Optional[Path] = None) -> list[dict]:
    """Stored skill specs of the chain, oldest first (runs recorded before lines kept none; a squash
    keeps those of the chain it replaced, flows/squash.py). With the artifact `store`, each reads
    the very files its release trained on (flows.skills.pinned_spec)."""
    specs = [(run["skill"], run.get("skill_files")) for run in taught_skills(ledger, champion)]
    if store is None:
        return [spec for spec, _ in specs]
    return [pinned_spec(spec, kept, store.fetch, cache) for spec, kept in specs]


def taught_by_chain(ledger, ctx: CycleContext, skill_sha256: str) -> Optional[str]:
    """The chain version that already taught this skill spec on this snapshot, if any."""
    for version, config in chain_specs(ledger, ctx.champion):
        if (
            config.get("skill")
            and SkillSpec.from_dict(config["skill"]) == ctx.skill
            and config.get("skill_sha256") == skill_sha256
        ):
            return version.name
    return None


def already_gated(db, ctx: CycleContext, run_keys: list[tuple[str, int, str]], eval_key: str) -> bool:
    """Every (method, seed, run key) is a finished run whose candidate versions are all retired
    or gated against the current champion with this policy and these evaluation settings."""
    from registry import evaluation_extra, find_training_run, latest_gate_decision, list_releases, run_versions

    renominated = {r.version_id: r.created_at for r in list_releases(db, ctx.model.id) if r.action == "renominate"}
    for method, seed, key in run_keys:
        found = find_training_run(db, ctx.backbone.ledger_id, ctx.skill.name, method, seed, key, model_id=ctx.model.id)
        if found is None or found[1] != "finished":
            return False
        for version in run_versions(db, found[0]):
            if version.status == "retired":
                continue
            decision = latest_gate_decision(db, version.id)
            if (
                decision is None
                or decision.release_version_id != ctx.champion_id
                or decision.policy_name != ctx.policy.label
                or decision.evaluation_id is None
                or renominated.get(version.id, decision.created_at) > decision.created_at
                or evaluation_extra(db, decision.evaluation_id).get("eval_key") != eval_key
            ):
                return False
    return True


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=transient_only)
def load_backbone_task(platform: PlatformRef, name: str, dtype: str) -> tuple[str, str, int, str]:
    """Load the backbone (first use converts the shipped GGUF; transient errors are retried);
    returns (revision, resolved dtype, number of decoder layers, weights sha256)."""
    from atlas_core.backbone import weights_sha256

    with scope(platform) as res:
        bb = res.load_backbone(name, dtype)
        return bb.revision, bb.dtype, bb.num_layers, weights_sha256(bb.model)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def record_lineage(
    platform: PlatformRef, name: str, revision: str, weights: str, line: str
) -> tuple[int, ModelInfo, VersionInfo, VersionInfo]:
    """Backbone, line and its base version in the ledger (get-or-create), and the champion's holder
    (the base while nobody holds it): (backbone id, line, base, champion)."""
    from registry import alias_holder, base_version, ensure_backbone, ensure_model

    with scope(platform) as res:
        db = res.ledger
        backbone_id = ensure_backbone(db, name, revision, weights)
        model = ensure_model(db, backbone_id, line)
        base = base_version(db, model.id)
        return backbone_id, model, base, alias_holder(db, model.id) or base


@flow(name="resolve_lineage", validate_parameters=True)
def resolve_lineage(
    config: UpdateConfig, policy: ReleasePolicy, platform: PlatformRef, flow_run_id: Optional[str] = None
) -> CycleContext:
    """The cycle's context: backbone, line, base, the champion with its whole chain loaded and
    verified, the skill taught now and the released skills it must keep, their scorers and the
    policy's thresholds for them validated before anything trains."""
    from .cycle import Applied, BackboneRef
    from .lineage import chain_skill_specs
    from .skills import SkillSpec, released_skills

    with scope(platform) as res:
        revision, dtype, layers, weights = load_backbone_task(platform, config.backbone, config.dtype)
        backbone_id, model, base, holder = record_lineage(
            platform, config.backbone, revision, weights, config.line_name
        )
        layer = layers // 2 if config.layer == -1 else config.layer
        champion = res.resolve_applied(holder)
        skill = SkillSpec.from_config(config)
        kept = chain_skill_specs(res.ledger, champion, res.platform.store, res.state / "cache" / "snapshots")
        released = released_skills(kept, skill.name)
        check_skills(res, policy, skill, released)
        return CycleContext(
            config=config,
            policy=policy,
            backbone=BackboneRef(config.backbone, revision, dtype, backbone_id, layer),
            model=model,
            base=Applied(base),
            champion=champion,
            skill=skill,
            platform=platform,
            released=tuple(released),
            flow_run_id=flow_run_id,
        )


def check_skills(res: Resources, policy: ReleasePolicy, skill, released: list) -> None:
    """Everything a cycle will read of each skill, resolved before anything trains."""
    from .metrics import regression_kind
    from .policy import PASS_FAIL
    from .skills import require_evaluable

    scorer = res.scorer
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
