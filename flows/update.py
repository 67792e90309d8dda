"""update: the whole scheduled cycle.

    prepare -> refresh_atlas -> train_skill -> evaluate_candidate (each) -> gate -> promote -> report

Run it with `atlas update`, from a deployment (deploy/prefect.yaml), or from Python:
`update(config="configs/update/default.yaml", policy="configs/policy/default.yaml")`.
Every stage is safe to rerun: a crashed cycle started again reuses the atlas, resumes
training, reuses stored answers and evaluations, and records nothing twice.
"""
from __future__ import annotations

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
    """Backbone, registered model and its base version in the ledger (get-or-create)."""
    from registry import base_version, ensure_backbone, ensure_model

    cycle.backbone_id = ensure_backbone(cycle.ledger, cycle.backbone.name, cycle.backbone.revision)
    cycle.model = ensure_model(cycle.ledger, cycle.backbone_id, cycle.config.skill)
    cycle.base = base_version(cycle.ledger, cycle.model.id)


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
        return f"No new candidates; the champion stays **{champion.name}**."
    if release is not None:
        s = outcome.selected
        return (f"**PROMOTED {s.name}** (was {champion.name}): passed every check of policy `{cycle.policy.label}`; "
                f"target {s.target_solved}/{s.target_total}; lowest retained KL among "
                f"{sum(outcome.verdict(c.version_id) for c in candidates)} passing candidate(s).")
    if outcome.selected is not None:
        return (f"**NOT PROMOTED**: {outcome.selected.name} passed, but another cycle moved `champion` since it was "
                f"measured; the champion stays as recorded in the ledger.")
    reasons = [f"- {c.name}: failed " + ", ".join(ch.name for ch in outcome.checks[c.version_id] if not ch.passed)
               for c in candidates]
    return f"**REJECTED**: no candidate passed policy `{cycle.policy.label}`; the champion stays **{champion.name}**.\n\n" \
        + "\n".join(reasons)


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
             f"(experiment '{model.backbone} / {model.skill}', registered model '{model.name}')",
             f"History: `atlas history --backbone {model.backbone} --skill {model.skill}`",
             f"Explain a verdict: `atlas gate --explain VERSION --backbone {model.backbone} --skill {model.skill}`"]
    text = outcome_text(cycle, outcome, release, champion, candidates)
    path = write_report(folder, header, text, candidates, outcome, comparison, where)
    create_markdown_artifact(key="update-report", markdown=path.read_text(), description=f"{model.name}: {text[:200]}")
    run_id = p.bridge.start_run(model.backbone, model.skill, f"update-cycle-{folder.name}",
                                {"policy": cycle.policy.label, "config": cycle.config.name,
                                 "flow_run_id": cycle.flow_run_id or "-"}, tags={"kind": "update-cycle"})
    p.bridge.log_folder(run_id, folder, "report")
    p.bridge.end_run(run_id)
    return str(path)


@flow(name="update", validate_parameters=True)
def update(config: str = DEFAULT_CONFIG, policy: str = DEFAULT_POLICY, backbone: Optional[str] = None,
           skill: Optional[str] = None) -> dict:
    """One update cycle: refresh the atlas, train the policy's candidates, evaluate, gate, promote, report."""
    from prefect.runtime import flow_run
    from registry import alias_holder

    from .components import make_scorer
    from .config import load_update_config
    from .cycle import Cycle, apply_version
    from .evaluate import evaluate_candidate, record_base
    from .platform import open_platform
    from .policy import load_policy
    from .refresh import refresh_atlas
    from .release import gate, promote
    from .training import train_skill

    cfg = load_update_config(config, backbone=backbone, skill=skill)
    pol = load_policy(policy, cfg.retained.domains)
    cycle = Cycle(cfg, pol, open_platform(), flow_run_id=flow_run.id)
    log = get_run_logger()
    try:
        load_backbone_task(cycle)
        record_lineage(cycle)
        for variant in needed_atlas_variants(cycle):
            refresh_atlas(cycle, variant)
        version_ids = train_skill(cycle)
        champion_v = alias_holder(cycle.ledger, cycle.model.id) or cycle.base
        champion, base = apply_version(cycle, champion_v), apply_version(cycle, cycle.base)
        scorer = make_scorer(cfg, cycle.backbone.tokenizer)
        candidates = [evaluate_candidate(cycle, v, champion, base, scorer) for v in version_ids if v != champion_v.id]
        record_base(cycle, base, scorer)
        outcome = gate(cycle, candidates, None if champion_v.is_base else champion_v.id)
        release = None
        if outcome.selected is not None:
            s = outcome.selected
            reason = (f"gate {pol.label} passed; target {s.target_solved}/{s.target_total} "
                      f"(+{s.target_solved - (s.champion_solved or 0)} over {champion_v.name}); lowest retained KL")
            release = promote(cycle, s.version_id, reason)
        report = publish_report(cycle, candidates, outcome, champion_v, release)
        log.info(f"report: {report}")
        new_champion = alias_holder(cycle.ledger, cycle.model.id) or cycle.base
        return {"model": cycle.model.name, "promoted": release is not None, "champion": new_champion.name,
                "previous_champion": champion_v.name, "selected": outcome.selected.name if outcome.selected else None,
                "candidates": {c.name: outcome.verdict(c.version_id) for c in candidates}, "report": report,
                "state": str(cycle.platform.state)}
    finally:
        cycle.platform.close()
