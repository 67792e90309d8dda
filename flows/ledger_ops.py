"""Read-only ledger queries the flows need beyond registry's public API.

They read registry's tables directly (plain selects in one transaction) and return plain
values; every write still goes through registry's functions.
"""
from __future__ import annotations

from typing import Optional

from sqlalchemy import select

from registry import Ledger
from registry.models import Checkpoint, Evaluation, GateDecision, ModelVersion, TrainingRun


def find_training_run(ledger: Ledger, backbone_id: int, skill: str, method: str, seed: int,
                      run_key: str) -> Optional[tuple[int, str]]:
    """(id, status) of the training run with this content key, so a rerun resumes it."""
    with ledger.transaction() as s:
        rows = s.scalars(select(TrainingRun).where(
            TrainingRun.backbone_id == backbone_id, TrainingRun.skill == skill, TrainingRun.method == method,
            TrainingRun.seed == seed).order_by(TrainingRun.id))
        for row in rows:
            if (row.config or {}).get("run_key") == run_key:
                return row.id, row.status
    return None


def run_checkpoints(ledger: Ledger, training_run_id: int) -> list[tuple[int, int, int, dict]]:
    """(checkpoint id, epoch, step, metrics) of a training run, oldest first."""
    with ledger.transaction() as s:
        rows = s.scalars(select(Checkpoint).where(Checkpoint.training_run_id == training_run_id)
                         .order_by(Checkpoint.step))
        return [(r.id, r.epoch, r.step, dict(r.metrics)) for r in rows]


def evaluation_extra(ledger: Ledger, evaluation_id: int) -> dict:
    with ledger.transaction() as s:
        row = s.get(Evaluation, evaluation_id)
        return dict(row.extra) if row is not None else {}


def recent_decisions(ledger: Ledger, model_id: int, limit: int = 10) -> list[tuple[int, str, bool, str, str]]:
    """(decision id, version name, passed, policy, when) of a model's latest gate decisions."""
    with ledger.transaction() as s:
        rows = s.execute(select(GateDecision, ModelVersion.name).join(
            ModelVersion, GateDecision.model_version_id == ModelVersion.id)
            .where(ModelVersion.registered_model_id == model_id)
            .order_by(GateDecision.id.desc()).limit(limit)).all()
        return [(d.id, name, d.passed, d.policy_name, d.created_at.strftime("%Y-%m-%d %H:%M:%S")) for d, name in rows]


def recent_training_runs(ledger: Ledger, backbone_id: int, skill: str, limit: int = 10) -> list[dict]:
    with ledger.transaction() as s:
        rows = s.scalars(select(TrainingRun).where(TrainingRun.backbone_id == backbone_id, TrainingRun.skill == skill)
                         .order_by(TrainingRun.id.desc()).limit(limit))
        return [{"id": r.id, "method": r.method, "seed": r.seed, "status": r.status, "flow_run_id": r.flow_run_id,
                 "started": r.started_at.strftime("%Y-%m-%d %H:%M:%S")} for r in rows]


def atlas_files(ledger: Ledger, atlas_id: int) -> tuple[str, str]:
    """(artifact sha256, manifest sha256) of a recorded atlas, to load an older champion's atlas."""
    from registry.models import Atlas

    with ledger.transaction() as s:
        row = s.get(Atlas, atlas_id)
        if row is None:
            raise ValueError(f"atlas id {atlas_id} is not in the ledger")
        return row.artifact_sha256, dict(row.config)["manifest_sha256"]
