"""What a line's history says about the cycle at hand: released skills and idleness.

Both read the ledger through registry's public functions only:
- `chain_skill_specs`: the skill specs stored on the training runs of the champion's chain
  (what each release taught, so later cycles keep it);
- `idle_reason`: why this cycle has nothing new to do, or None. A cycle is idle when the
  snapshot it would teach is already taught by the champion's chain, or when every
  candidate it would train already exists, finished, and was gated against this champion
  with this policy and these evaluation settings (a rerun); rolled-back (retired) versions
  count as decided: no cycle promotes them again unless a person re-nominates them, after
  which the next cycle gates them again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .cycle import Applied, CycleContext
from .skills import SkillSpec, pinned_spec


def chain_specs(ledger, champion: Applied) -> list[tuple[object, dict]]:
    """(version, its training run's stored config) for every delta of the champion's chain."""
    from registry import training_run_config

    return [(v, training_run_config(ledger, v.training_run_id)) for v in champion.deltas]


def chain_skill_specs(ledger, champion: Applied, store=None, cache: Optional[Path] = None) -> list[dict]:
    """Stored skill specs of the chain, oldest first (runs recorded before lines kept none). With
    the artifact `store`, each reads the very files its release trained on (flows.skills.pinned_spec)."""
    specs = [
        (config["skill"], config.get("skill_files")) for _, config in chain_specs(ledger, champion) if "skill" in config
    ]
    if store is None:
        return [spec for spec, _ in specs]
    return [pinned_spec(spec, kept, store.fetch, cache) for spec, kept in specs]


def taught_by_chain(ctx: CycleContext, skill_sha256: str) -> Optional[str]:
    """The chain version that already taught this skill spec on this snapshot, if any."""
    from .runtime import ledger

    for version, config in chain_specs(ledger(), ctx.champion):
        if (
            config.get("skill")
            and SkillSpec.from_dict(config["skill"]) == ctx.skill
            and config.get("skill_sha256") == skill_sha256
        ):
            return version.name
    return None


def already_gated(ctx: CycleContext, run_keys: list[tuple[str, int, str]], eval_key: str) -> bool:
    """Every (method, seed, run key) is a finished run whose candidate versions are all retired
    or gated against the current champion with this policy and these evaluation settings."""
    from registry import evaluation_extra, find_training_run, latest_gate_decision, list_releases, run_versions

    from .runtime import ledger

    db = ledger()
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
