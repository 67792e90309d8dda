"""Read-only views of the ledger that the flows and the CLI need: each returns plain values
(tuples, dicts, records), never ORM rows. Also: a version named the way people name it
(`resolve_version`) and a line's release log (`release_history`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sqlalchemy import select

from registry.db import Ledger, LedgerError
from registry.lines import base_version, get_model, get_version, list_versions, version_info
from registry.mlflow_bridge import MANAGED_ALIASES
from registry.models import Atlas, Checkpoint, Evaluation, GateDecision, ModelVersion, TrainingRun
from registry.promotion import alias_holder, list_releases
from registry.records import VersionInfo
from registry.results import latest_evaluation
from registry.rows import require_row


def find_training_run(
    ledger: Ledger,
    backbone_id: int,
    skill: str,
    method: str,
    seed: int,
    run_key: str,
    *,
    model_id: Optional[int] = None,
) -> Optional[tuple[int, str]]:
    """(id, status) of the training run with this content key, so a rerun resumes it.

    With `model_id`, only a run trained for that line counts.
    """
    with ledger.transaction() as s:
        query = select(TrainingRun).where(
            TrainingRun.backbone_id == backbone_id,
            TrainingRun.skill == skill,
            TrainingRun.method == method,
            TrainingRun.seed == seed,
        )
        if model_id is not None:
            query = query.where(TrainingRun.registered_model_id == model_id)
        for row in s.scalars(query.order_by(TrainingRun.id)):
            if (row.config or {}).get("run_key") == run_key:
                return row.id, row.status
    return None


def run_checkpoints(ledger: Ledger, training_run_id: int) -> list[tuple[int, int, int, dict]]:
    """(checkpoint id, epoch, step, metrics) of a training run, oldest first."""
    with ledger.transaction() as s:
        rows = s.scalars(
            select(Checkpoint).where(Checkpoint.training_run_id == training_run_id).order_by(Checkpoint.step)
        )
        return [(r.id, r.epoch, r.step, dict(r.metrics)) for r in rows]


def training_run_config(ledger: Ledger, training_run_id: int) -> dict:
    """The config stored with a training run when it started."""
    with ledger.transaction() as s:
        return dict(require_row(s, TrainingRun, training_run_id, "training run").config)


def run_versions(ledger: Ledger, training_run_id: int) -> list[VersionInfo]:
    """The versions registered from a training run's checkpoints, oldest first."""
    with ledger.transaction() as s:
        require_row(s, TrainingRun, training_run_id, "training run")
        rows = s.scalars(
            select(ModelVersion)
            .join(Checkpoint, ModelVersion.checkpoint_id == Checkpoint.id)
            .where(Checkpoint.training_run_id == training_run_id)
            .order_by(ModelVersion.id)
        )
        return [version_info(s, row) for row in rows]


def evaluation_extra(ledger: Ledger, evaluation_id: int) -> dict:
    """The free-form `extra` of an evaluation ({} when there is no such evaluation)."""
    with ledger.transaction() as s:
        row = s.get(Evaluation, evaluation_id)
        return dict(row.extra) if row is not None else {}


def recent_decisions(ledger: Ledger, model_id: int, limit: int = 10) -> list[tuple[int, str, bool, str, str]]:
    """(decision id, version name, passed, policy, when) of a line's latest gate decisions."""
    with ledger.transaction() as s:
        rows = s.execute(
            select(GateDecision, ModelVersion.name)
            .join(ModelVersion, GateDecision.model_version_id == ModelVersion.id)
            .where(ModelVersion.registered_model_id == model_id)
            .order_by(GateDecision.id.desc())
            .limit(limit)
        ).all()
        return [(d.id, name, d.passed, d.policy_name, d.created_at.strftime("%Y-%m-%d %H:%M:%S")) for d, name in rows]


def recent_training_runs(
    ledger: Ledger, backbone_id: int, skill: Optional[str], limit: int = 10, *, model_id: Optional[int] = None
) -> list[dict]:
    """The latest training runs on a backbone, newest first: of one skill, and/or (with
    `model_id`) of one line; skill=None means every skill."""
    with ledger.transaction() as s:
        query = select(TrainingRun).where(TrainingRun.backbone_id == backbone_id)
        if skill is not None:
            query = query.where(TrainingRun.skill == skill)
        if model_id is not None:
            query = query.where(TrainingRun.registered_model_id == model_id)
        rows = s.scalars(query.order_by(TrainingRun.id.desc()).limit(limit))
        return [
            {
                "id": r.id,
                "skill": r.skill,
                "method": r.method,
                "seed": r.seed,
                "status": r.status,
                "flow_run_id": r.flow_run_id,
                "started": r.started_at.strftime("%Y-%m-%d %H:%M:%S"),
            }
            for r in rows
        ]


def recorded_manifest_sha256(ledger: Ledger, version_id: int) -> Optional[str]:
    """The sha256 of a version's release manifest.json the ledger recorded (None: never written yet)."""
    with ledger.transaction() as s:
        return require_row(s, ModelVersion, version_id, "model version").manifest_sha256


def atlas_config(ledger: Ledger, atlas_id: int) -> dict:
    """The config recorded with an atlas (its fit plan and the manifest's sha256)."""
    with ledger.transaction() as s:
        return dict(require_row(s, Atlas, atlas_id, "atlas").config)


def atlas_files(ledger: Ledger, atlas_id: int) -> tuple[str, str]:
    """(artifact sha256, manifest sha256) of a recorded atlas, to load an older champion's atlas."""
    with ledger.transaction() as s:
        row = s.get(Atlas, atlas_id)
        if row is None:
            raise LedgerError(f"atlas id {atlas_id} does not exist in the ledger")
        manifest = dict(row.config).get("manifest_sha256")
        if manifest is None:
            raise LedgerError(f"atlas id {atlas_id}: its config has no manifest_sha256")
        return row.artifact_sha256, manifest


def submission(ledger: Ledger, version: VersionInfo) -> Optional[dict]:
    """What `atlas submit` recorded on the version's run (source, sha256, format, kind); None for
    the base and for versions an update cycle trained."""
    if version.training_run_id is None:
        return None
    return training_run_config(ledger, version.training_run_id).get("submitted") or None


def version_source(ledger: Ledger, version: VersionInfo) -> str:
    """Where a version's delta came from: 'base', 'trained' (an update cycle), or 'submitted
    <format> sha256:<first 12> from <path or URI>' (`atlas submit`: an adapter trained elsewhere)."""
    submitted = submission(ledger, version)
    if not submitted:
        return "base" if version.training_run_id is None else "trained"
    return (
        f"submitted {submitted.get('format', '?')} sha256:{str(submitted.get('sha256'))[:12]} "
        f"from {submitted.get('source', '?')}"
    )


def resolve_version(ledger: Ledger, model: int | str, ref: str) -> VersionInfo:
    """A version of `model` named the way people name it on a command line:
    'base', an alias ('champion', 'candidate'), 'mlflow:<n>', '#<ledger id>' or a version name.
    'champion' while nobody holds it is the base version: the base is what serves then.

    The form of `ref` decides what it is matched against, and names are unique within a
    line, so a reference never matches two versions.
    """
    info = get_model(ledger, model)
    if ref == "base":
        return base_version(ledger, info.id)
    if ref in MANAGED_ALIASES:
        holder = alias_holder(ledger, info.id, ref)
        if holder is None and ref == "champion":  # nobody holds it (never released, or rolled back to the base)
            return base_version(ledger, info.id)
        if holder is None:
            raise LedgerError(f"{info.name}: nobody holds {ref!r}")
        return holder
    versions = list_versions(ledger, info.id)
    if ref.startswith("#"):
        matches = [v for v in versions if f"#{v.id}" == ref]
    elif ref.startswith("mlflow:"):
        matches = [v for v in versions if v.mlflow_version is not None and f"mlflow:{v.mlflow_version}" == ref]
    else:
        matches = [v for v in versions if v.name == ref]
    if not matches:
        known = ", ".join(v.name for v in versions) or "none"
        raise LedgerError(f"{info.name}: version {ref!r} matches 0 versions (known: {known})")
    if len(matches) > 1:  # the unique (line, name) constraint makes this a corrupted ledger
        raise LedgerError(
            f"{info.name}: version {ref!r} matches {len(matches)} versions: {', '.join(f'#{v.id}' for v in matches)}"
        )
    return matches[0]


@dataclass(frozen=True)
class HistoryRow:
    """One release of a line with the released version's key metrics (flows.compare.format_history
    prints them)."""

    release_id: int
    when: str
    action: str
    alias: str
    version: str
    previous: str
    target: str
    max_kl_vs_base: Optional[float]
    nfr_vs_base: Optional[float]  # None: not measured, or no questions compared (n = 0)
    flow_run_id: Optional[str]
    reason: str
    source: str = "-"  # trained | submitted ... (version_source)


def release_history(ledger: Ledger, model_id: int, alias: Optional[str] = "champion") -> list[HistoryRow]:
    """Every release of a model (oldest first) with the released version's key metrics."""
    rows = []
    for r in list_releases(ledger, model_id, alias):
        v = get_version(ledger, r.version_id)
        ev = latest_evaluation(ledger, r.version_id)
        churn = ev.churn_total("base") if ev else None
        rows.append(
            HistoryRow(
                release_id=r.id,
                when=r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                action=r.action,
                alias=r.alias,
                version=v.name,
                previous=get_version(ledger, r.previous_version_id).name if r.previous_version_id else "-",
                target=f"{ev.target_solved}/{ev.target_total}" if ev else "-",
                max_kl_vs_base=ev.max_kl("kl_vs_base") if ev else None,
                nfr_vs_base=churn.nfr if churn else None,
                flow_run_id=r.flow_run_id,
                reason=r.reason,
                source=version_source(ledger, v),
            )
        )
    return rows
