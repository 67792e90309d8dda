"""The release ledger, the verified artifact store and the MLflow bridge.

Depends on nothing else in the project: callers pass plain records (dataclasses, paths,
floats). The ledger (SQLite file or PostgreSQL URL) is the source of truth; MLflow mirrors it.

Public API (all functions take the `Ledger` returned by `init_db` first):

Database        init_db(url) -> Ledger; upgrade(url, revision="head"); downgrade(url, revision);
                default_ledger_url(state_dir) -> str
Artifacts       ArtifactStore(root).put_file(path) / put_bytes(data) -> StoredArtifact(sha256, size, uri);
                .read_bytes(sha) / .fetch(sha, dest) / .verify(sha) / .local_path(sha);
                errors: ArtifactError > ArtifactMissingError, ArtifactCorruptedError (.path, .expected_sha256)
Lineage         ensure_backbone(ledger, name, revision) -> id; ensure_dataset(ledger, name, split, sha256) -> id;
                find_atlas(ledger, content_hash); record_atlas(ledger, content_hash, backbone_id, layer, config,
                artifact, dataset_ids) -> AtlasInfo; start_training_run(ledger, backbone_id, skill, method, seed,
                config, atlas_id=, dataset_id=, flow_run_id=, *, model_id=, parent_version_id=) -> id;
                finish_training_run(ledger, id, status); record_checkpoint(ledger, run_id, epoch, step, adapter,
                metrics) -> CheckpointInfo; last_checkpoint(ledger, run_id)
Lines           ensure_model(ledger, backbone_id, line) -> ModelInfo; get_model(ledger, id_or_name);
                model_name_for(backbone, line); register_version(ledger, checkpoint_id) -> VersionInfo;
                base_version(ledger, model_id) -> VersionInfo; get_version(ledger, id);
                list_versions(ledger, model_id, include_retired=True);
                version_chain(ledger, version_id) -> [VersionInfo]
                (the deltas from the first after the base to this one); ModelInfo.line; VersionInfo.line,
                .skill (what its delta taught; None for the base), .parent_id, .status ("active" | "retired")
Queries         find_training_run(ledger, backbone_id, skill, method, seed, run_key, *, model_id=) -> (id, status);
                run_checkpoints(ledger, run_id) -> [(id, epoch, step, metrics)]; training_run_config(ledger, run_id)
                -> dict; run_versions(ledger, run_id) -> [VersionInfo]; evaluation_extra(ledger, id) -> dict;
                recent_decisions(ledger, model_id, limit); recent_training_runs(ledger, backbone_id, skill, limit,
                *, model_id=) -> [dict]; atlas_files(ledger, atlas_id) -> (artifact sha256, manifest sha256);
                recorded_manifest_sha256(ledger, version_id) -> sha256 of its release manifest.json, or None
MLflow          MlflowConfig.local(state_dir) / .server(url, artifact_root); MlflowBridge(config);
                ensure_mlflow_run(ledger, bridge, training_run_id) -> run_id; log_checkpoint(ledger, bridge,
                checkpoint_id); publish_version(ledger, store, bridge, version_id) -> mlflow version;
                sync_version_tags(ledger, bridge, version_id); MANIFEST_TAG (the version's manifest sha256)
Release folders write_release_folder(ledger, store, version_id, folder) -> manifest (records the manifest's
                sha256 once: a later write that differs raises ArtifactError); release_manifest_sha256(ledger,
                version_id) -> the recorded sha256 (computed from the ledger and recorded on first use)
Releases        promote(ledger, bridge, version_id, alias="champion", reason=, flow_run_id=,
                expected_current=FROM_GATE, require_gate=True) -> ReleaseInfo; mark_candidate(...);
                rollback(ledger, bridge, model_id, reason) -> ReleaseInfo (to the previous holder, else the base;
                retires the rolled-back version); renominate(ledger, version_id, reason) -> ReleaseInfo;
                repair(ledger, bridge) -> changes;
                alias_holder(ledger, model_id, alias); list_releases(ledger, model_id);
                errors: PromotionError > PromotionConflict, GateNotPassed, RollbackError
Versions        resolve_version(ledger, model_id_or_name, "base" | "champion" | name | "mlflow:<n>" | "#<id>");
                release_history(ledger, model_id) -> [HistoryRow] (flows.compare.format_history prints them)
Flips           Flips(n, F, G, W): the one flip record (.churn, .nfr: None when n = 0; Flips.tally(kinds),
                Flips.total(parts)); flip_kind(ref_correct, ref_answer, new_correct, new_answer) -> "F" | "G" |
                "W" | None: the one classifier; ChurnCounts: an evaluation's Flips on one domain as stored (.flips)
(The version comparison and its report are above the registry: flows.compare.compare_versions.)
"""

from types import ModuleType as _ModuleType

from registry.db import Ledger, LedgerError, default_ledger_url, downgrade, init_db, upgrade
from registry.lineage import (
    complete_run_config,
    ensure_backbone,
    ensure_dataset,
    find_atlas,
    find_atlas_file,
    finish_training_run,
    last_checkpoint,
    link_mlflow_run,
    record_atlas,
    record_checkpoint,
    start_training_run,
)
from registry.lines import (
    base_version,
    ensure_model,
    get_model,
    get_version,
    list_versions,
    model_name_for,
    register_version,
    version_chain,
)
from registry.mlflow_bridge import MANAGED_ALIASES, MlflowBridge, MlflowConfig, PyfuncModel
from registry.promotion import (
    ANY_HOLDER,
    FROM_GATE,
    GateNotPassed,
    PromotionConflict,
    PromotionError,
    RollbackError,
    alias_holder,
    list_releases,
    mark_candidate,
    promote,
    renominate,
    repair,
    rollback,
)
from registry.publish import (
    MANIFEST_TAG,
    end_mlflow_run,
    ensure_mlflow_run,
    log_checkpoint,
    publish_version,
    release_manifest_sha256,
    sync_version_tags,
    version_tags,
    write_release_folder,
)
from registry.queries import (
    HistoryRow,
    atlas_files,
    evaluation_extra,
    find_training_run,
    recent_decisions,
    recent_training_runs,
    recorded_manifest_sha256,
    release_history,
    resolve_version,
    run_checkpoints,
    run_versions,
    training_run_config,
)
from registry.records import (
    AnswerRecord,
    AtlasInfo,
    CheckpointInfo,
    ChurnCounts,
    DomainKL,
    EvaluationInfo,
    EvaluationRecord,
    Flips,
    GateCheckRecord,
    GateDecisionInfo,
    ModelInfo,
    ReleaseInfo,
    VersionInfo,
    flip_kind,
)
from registry.results import (
    get_answers,
    latest_evaluation,
    latest_gate_decision,
    record_answers,
    record_evaluation,
    record_gate_decision,
)
from registry.rows import require_name
from registry.store import (
    ArtifactCorruptedError,
    ArtifactError,
    ArtifactMissingError,
    ArtifactStore,
    StoredArtifact,
    atomic_write_text,
    sha256_bytes,
    sha256_file,
)

# Everything imported above except the submodules themselves.
__all__ = sorted(
    name for name, value in dict(globals()).items() if not name.startswith("_") and not isinstance(value, _ModuleType)
)
