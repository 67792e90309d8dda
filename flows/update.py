"""update: the whole scheduled cycle, for one skill on one line.

    prepare -> refresh_atlas -> (idle?) -> train_skill -> evaluate_candidate (each) -> gate -> promote -> report

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

from dataclasses import replace
from typing import Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from .platform import DEFAULT_CONFIG, DEFAULT_POLICY, configure_environment

configure_environment()


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def load_backbone_task(cycle) -> None:
    """Load the backbone (first use converts the shipped GGUF; transient I/O errors are retried)."""
    from .components import load_model

    cycle.backbone = load_model(cycle.config.backbone, cycle.config.dtype)
    cycle.layer = cycle.backbone.middle_layer if cycle.config.layer == -1 else cycle.config.layer


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def record_lineage(cycle) -> None:
    """Backbone, line and its base version in the ledger (get-or-create); the champion and its chain."""
    from registry import alias_holder, base_version, ensure_backbone, ensure_model

    from .cycle import apply_version

    cycle.backbone_id = ensure_backbone(cycle.ledger, cycle.backbone.name, cycle.backbone.revision)
    cycle.model = ensure_model(cycle.ledger, cycle.backbone_id, cycle.config.line_name)
    cycle.base = base_version(cycle.ledger, cycle.model.id)
    cycle.champion = apply_version(cycle, alias_holder(cycle.ledger, cycle.model.id) or cycle.base)


def prepare_skills(cycle) -> None:
    """The skill taught now, the released skills it must keep, their scorers: all validated
    (scorer names and options, policy thresholds) before anything trains."""
    from .components import make_scorer
    from .lineage import chain_skill_specs
    from .skills import SkillSpec, released_skills

    cycle.skill = SkillSpec.from_config(cycle.config)
    cycle.released = released_skills(chain_skill_specs(cycle), cycle.skill.name)
    cycle.released_scorers = {s.name: make_scorer(s) for s in cycle.released}
    cycle.policy.require_released([s.name for s in cycle.released])


def needed_atlas_variants(cycle) -> list[str]:
    from atlas_core.residual import RESIDUAL_VARIANTS
    from atlas_core.train import load_run_config

    from .config import resolve

    variants = []
    for method in cycle.policy.candidates.methods:
        path = resolve(f"{cycle.config.train.configs_dir}/{method}.yaml")
        if not path.is_file():
            raise ValueError(f"candidates.methods: no run config {path} for method {method!r}")
        adapter = load_run_config(path).adapter
        variant = None if adapter == "weight-lora" else RESIDUAL_VARIANTS[adapter]
        if variant and variant not in variants:
            variants.append(variant)
    return variants


def outcome_text(cycle, outcome, release, champion, candidates) -> str:
    if not candidates:
        return f"No candidates to gate (every one is retired); the champion stays **{champion.name}**."
    if release is not None:
        s = outcome.selected
        return (f"**PROMOTED {s.name}** (was {champion.name}): passed every check of policy `{cycle.policy.label}`; "
                f"target {s.target_score:g} (champion {s.champion_score:g}); lowest retained KL among "
                f"{sum(outcome.verdict(c.version_id) for c in candidates)} passing candidate(s).")
    if outcome.selected is not None:
        return (f"**NOT PROMOTED**: {outcome.selected.name} passed, but another cycle moved `champion` since it was "
                f"measured; the champion stays as recorded in the ledger.")
    reasons = [f"- {c.name}: failed " + ", ".join(ch.name for ch in outcome.checks[c.version_id] if not ch.passed)
               for c in candidates]
    return f"**REJECTED**: no candidate passed policy `{cycle.policy.label}`; the champion stays **{champion.name}**.\n\n" \
        + "\n".join(reasons)


def line_after(cycle, release):
    """The line's history after this cycle (None while only the base serves); a promotion also
    logs the newest row (R[T][i], OP, BWT, KL vs base) on the promoted version's MLflow run."""
    from registry import alias_holder, ensure_mlflow_run

    from .history import line_history

    champion = alias_holder(cycle.ledger, cycle.model.id)
    if champion is None:
        return None
    history = line_history(cycle.ledger, cycle.model.id, champion.id)
    if release is not None:
        run_id = ensure_mlflow_run(cycle.ledger, cycle.platform.bridge, champion.training_run_id)
        cycle.platform.bridge.log_metrics(run_id, history.metrics(), champion.step)
    return history


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3)
def publish_report(cycle, candidates, outcome, champion, release) -> str:
    """Write the report, then publish it as a Prefect artifact and as an MLflow run's artifacts."""
    from registry import compare_versions

    from .report import report_folder, write_report

    p, model = cycle.platform, cycle.model
    folder = report_folder(p.state, model.name, cycle.flow_run_id)
    best = outcome.selected or (max(candidates, key=lambda c: (c.target_solved or 0, -c.mean_kl("kl_vs_champion")))
                                if candidates else None)
    comparison = compare_versions(cycle.ledger, champion.id, best.version_id).to_markdown() if best else None
    header = {"model": model.name, "flow run": cycle.flow_run_id or "-", "config": cycle.config.name,
              "policy": cycle.policy.label, "backbone": f"{cycle.backbone.name} @ {cycle.backbone.revision[:16]}",
              "layer": cycle.layer, "champion before": champion.name}
    where = [f"MLflow UI: `.venv/bin/mlflow ui --backend-store-uri {p.bridge.config.tracking_uri}` "
             f"(experiment '{model.backbone} / {model.line}', registered model '{model.name}')",
             f"History: `atlas history --model {model.name}`",
             f"Explain a verdict: `atlas gate --explain VERSION --model {model.name}`"]
    text = outcome_text(cycle, outcome, release, champion, candidates)
    history = line_after(cycle, release)
    path = write_report(folder, header, text, candidates, outcome, comparison, where, history)
    create_markdown_artifact(key="update-report", markdown=path.read_text(), description=f"{model.name}: {text[:200]}")
    run_id = p.bridge.start_run(model.backbone, model.line, f"update-cycle-{folder.name}",
                                {"policy": cycle.policy.label, "config": cycle.config.name,
                                 "flow_run_id": cycle.flow_run_id or "-"}, tags={"kind": "update-cycle"})
    p.bridge.log_folder(run_id, folder, "report")
    p.bridge.end_run(run_id)
    return str(path)


def idle_result(cycle, reason: str) -> dict:
    champion = cycle.champion.version
    get_run_logger().info(f"idle: {reason}")
    return {"model": cycle.model.name, "outcome": "idle", "promoted": False, "champion": champion.name,
            "previous_champion": champion.name, "selected": None, "candidates": {}, "report": None,
            "reason": reason, "state": str(cycle.platform.state)}


@flow(name="update", validate_parameters=True)
def update(config: str = DEFAULT_CONFIG, policy: str = DEFAULT_POLICY, backbone: Optional[str] = None,
           skill: Optional[str] = None, snapshot: Optional[str] = None, line: Optional[str] = None) -> dict:
    """One update cycle on a line: refresh the atlas on the champion, train the policy's candidates
    on top of it, evaluate them on everything the line keeps, gate, promote, report.

    `snapshot`: the skill's training data (a JSONL file, or a folder whose newest snapshot is taken);
    given, it replaces the config's `data.source`. `backbone`, `skill`, `line`: given, they replace the
    config's fields. Outcome: promoted | rejected | not-promoted (lost a race) | idle."""
    from prefect.runtime import flow_run
    from registry import alias_holder

    from .components import make_scorer
    from .config import load_update_config
    from .cycle import Cycle, apply_version
    from .evaluate import eval_key, evaluate_candidate, record_base
    from .lineage import already_gated, taught_by_chain
    from .platform import open_platform
    from .policy import load_policy
    from .refresh import refresh_atlas
    from .release import gate, promote
    from .skills import skill_set
    from .training import planned_runs, train_skill

    cfg = load_update_config(config, backbone=backbone, skill=skill, line=line)
    if snapshot is not None:
        cfg = replace(cfg, data=replace(cfg.data, source=snapshot))
    pol = load_policy(policy, cfg.domain_names)
    cycle = Cycle(cfg, pol, open_platform(), flow_run_id=flow_run.id)
    log = get_run_logger()
    try:
        load_backbone_task(cycle)
        record_lineage(cycle)
        prepare_skills(cycle)
        scorer = make_scorer(cycle.skill)
        data = skill_set(cycle.skill)
        taught = taught_by_chain(cycle, data.sha256)
        if taught is not None:
            return idle_result(cycle, f"skill {cycle.skill.name!r} snapshot {data.sha256[:12]} is already released "
                                      f"in the champion's chain ({taught}); nothing new to train")
        for variant in needed_atlas_variants(cycle):
            refresh_atlas(cycle, variant)
        keys = [(m, s, k) for m, s, _, _, k in planned_runs(cycle, data)]
        if already_gated(cycle, keys, eval_key(cycle)):
            return idle_result(cycle, f"every candidate of this snapshot was already gated against "
                                      f"{cycle.champion.version.name} with policy {pol.label}")
        version_ids = train_skill(cycle)
        champion = cycle.champion
        base = champion if champion.version.is_base else apply_version(cycle, cycle.base)
        champion_v = champion.version
        candidates = [evaluate_candidate(cycle, v, champion, base, scorer) for v in version_ids if v != champion_v.id]
        record_base(cycle, base, scorer)
        outcome = gate(cycle, candidates, None if champion_v.is_base else champion_v.id)
        release = None
        if outcome.selected is not None:
            s = outcome.selected
            reason = (f"gate {pol.label} passed; {cycle.skill.name} {s.target_score:g} (champion "
                      f"{s.champion_score:g}) on top of {champion_v.name}; lowest retained KL")
            release = promote(cycle, s.version_id, reason)
        report = publish_report(cycle, candidates, outcome, champion_v, release)
        log.info(f"report: {report}")
        new_champion = alias_holder(cycle.ledger, cycle.model.id) or cycle.base
        result = ("promoted" if release is not None else "not-promoted" if outcome.selected is not None else "rejected")
        return {"model": cycle.model.name, "outcome": result, "promoted": release is not None,
                "champion": new_champion.name, "previous_champion": champion_v.name,
                "selected": outcome.selected.name if outcome.selected else None,
                "candidates": {c.name: outcome.verdict(c.version_id) for c in candidates}, "report": report,
                "state": str(cycle.platform.state)}
    finally:
        cycle.platform.close()
