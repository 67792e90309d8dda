"""train_skill: train every (method, seed) the policy lists; checkpoints are recorded as they appear.

Every candidate trains one delta on the skill's snapshot with the champion's whole chain
attached and frozen (atlas_core.chain): the prefix cache then holds the champion's layer-l
states, and the new version's parent is the champion.

Each training run has a content key (backbone, layer, method config, atlas, data snapshot,
parent chain). A rerun
with the same key finds the same ledger row and the same run folder: a finished run is not
trained again, an interrupted one resumes from its newest complete checkpoint
(atlas_core.train), and recording a checkpoint twice is a no-op, so a crash anywhere
leaves neither gaps nor duplicates.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from .config import digest, resolve
from .skills import skill_set
from .cycle import Cycle


def run_config_for(cycle: Cycle, method: str, seed: int):
    """configs/train/<method>.yaml with this cycle's backbone, layer, atlas, seed and overrides."""
    from atlas_core.residual import RESIDUAL_VARIANTS
    from atlas_core.train import load_run_config

    over = cycle.config.train
    path = resolve(Path(over.configs_dir) / f"{method}.yaml")
    if not path.is_file():
        raise ValueError(f"candidates.methods: no run config {path} for method {method!r}")
    rc = load_run_config(path)
    changes = {k: getattr(over, k) for k in ("epochs", "lr", "batch_size", "max_length", "on_bad_example",
                                             "checkpoint_every_steps") if getattr(over, k) is not None}
    train = replace(rc.train, seed=seed, **changes)
    variant = RESIDUAL_VARIANTS.get(rc.adapter) if rc.adapter != "weight-lora" else None
    atlas = str(cycle.atlas_ids[variant][2]) if variant else None
    return replace(rc, backbone=cycle.backbone.name, layer=cycle.layer, atlas=atlas, train=train), variant


def run_key(cycle: Cycle, method: str, run_config, variant, skill) -> str:
    config = run_config.to_dict() | {"atlas": cycle.atlas_ids[variant][1].sha256 if variant else None}
    key = {"backbone": cycle.backbone.name, "revision": cycle.backbone.revision, "dtype": cycle.backbone.dtype,
           "method": method, "config": config, "data": [skill.dataset_name, skill.sha256, cycle.config.data.train_limit,
                                                         cycle.config.data.val_limit, cycle.config.retained.replay_examples]}
    if not cycle.champion.version.is_base:  # keys of runs on the bare backbone stay as they were before chains
        key["parent"] = [cycle.champion.version.id, cycle.champion.version.adapter_sha256]
    return digest(key)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def open_training_run(cycle: Cycle, method: str, seed: int, run_config, variant, key: str, dataset_id: int,
                      skill_sha256: str):
    """(training run id, status): the run with this key, or a new one."""
    from registry import ensure_mlflow_run, find_training_run, start_training_run

    found = find_training_run(cycle.ledger, cycle.backbone_id, cycle.skill.name, method, seed, key, model_id=cycle.model.id)
    if found is None:
        config = {"run_key": key, "run_config": run_config.to_dict() | {"atlas": None}, "skill": cycle.skill.to_dict(),
                  "skill_sha256": skill_sha256}
        atlas_id = cycle.atlas_ids[variant][0] if variant else None
        found = (start_training_run(cycle.ledger, cycle.backbone_id, cycle.skill.name, method, seed, config,
                                    atlas_id=atlas_id, dataset_id=dataset_id, flow_run_id=cycle.flow_run_id,
                                    model_id=cycle.model.id, parent_version_id=cycle.champion.version.id), "running")
    ensure_mlflow_run(cycle.ledger, cycle.platform.bridge, found[0])
    return found


def record_checkpoint_files(cycle: Cycle, training_run_id: int, path: Path) -> int:
    """Store a checkpoint's adapter (+ manifest), record and log it, register it if it is a candidate."""
    from atlas_core.train import read_state
    from registry import log_checkpoint, record_checkpoint, register_version, run_checkpoints

    state, store = read_state(path), cycle.platform.store
    adapter, manifest = store.put_file(path / "adapter.safetensors"), store.put_file(path / "adapter.json")
    known = {step for _, _, step, _ in run_checkpoints(cycle.ledger, training_run_id)}
    metrics = {"train_loss": state["train_losses"][-1] if state["train_losses"] else None,
               "val_loss": state["val_losses"].get(str(state["step"])), "epoch_end": bool(state.get("epoch_end")),
               "manifest_sha256": manifest.sha256}
    ckpt = record_checkpoint(cycle.ledger, training_run_id, state["epoch"], state["step"], adapter, metrics)
    if state["step"] not in known:
        log_checkpoint(cycle.ledger, cycle.platform.bridge, ckpt.id)
    if (state.get("epoch_end") and cycle.config.evaluate == "epoch-ends") or cycle.config.evaluate == "all":
        return register_version(cycle.ledger, ckpt.id).id
    return 0  # "final": registered once the run is finished (reconcile_checkpoints)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def train_run(cycle: Cycle, training_run_id: int, run_config, variant, skill, run_dir: Path) -> list[str]:
    """Train (resuming if the folder has checkpoints); each new checkpoint is recorded at once."""
    from atlas_core.train import build_adapter, prepare_data, train
    from evaluation.contexts import retained_contexts

    bb, tc = cycle.backbone, run_config.train
    retained = (retained_contexts(bb.tokenizer, "gsm8k", split="train", limit=cycle.config.retained.replay_examples)[1]
                if tc.objective.uses_retained else None)
    data = prepare_data(bb.tokenizer, skill.train, tc, val=skill.val or None, retained=retained)
    atlas = cycle.atlas_ids[variant][1] if variant else None
    with cycle.champion.on_model(bb.model):  # the parent's chain, frozen: the new delta learns on top of it
        adapter = build_adapter(run_config, bb.model, atlas)
        try:
            summary = train(bb.model, adapter, data, tc, run_dir, resume=True,
                            on_checkpoint=lambda path, _: record_checkpoint_files(cycle, training_run_id, path))
        finally:
            if hasattr(adapter, "remove"):  # Weight-LoRA lives inside the model; take it out again
                adapter.remove()
    return summary.checkpoints


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def reconcile_checkpoints(cycle: Cycle, training_run_id: int, checkpoints: list[str]) -> list[int]:
    """Record any checkpoint a crash left unrecorded; return the run's candidate version ids."""
    from registry import finish_training_run, register_version, run_checkpoints

    for path in checkpoints:
        if Path(path).is_dir():
            record_checkpoint_files(cycle, training_run_id, Path(path))
    finish_training_run(cycle.ledger, training_run_id, "finished")
    recorded = run_checkpoints(cycle.ledger, training_run_id)
    mode = cycle.config.evaluate
    eligible = [cid for cid, _, _, m in recorded if mode == "all" or (mode == "epoch-ends" and m.get("epoch_end"))]
    if mode == "final" and recorded:
        eligible = [recorded[-1][0]]
    return [register_version(cycle.ledger, cid).id for cid in eligible]


def planned_runs(cycle: Cycle, skill) -> list[tuple[str, int, object, object, str]]:
    """(method, seed, run config, atlas variant, run key) of every candidate the policy lists."""
    out = []
    for method in cycle.policy.candidates.methods:
        for seed in cycle.policy.candidates.seeds:
            run_config, variant = run_config_for(cycle, method, seed)
            out.append((method, seed, run_config, variant, run_key(cycle, method, run_config, variant, skill)))
    return out


@flow(name="train_skill", validate_parameters=False)
def train_skill(cycle: Cycle) -> list[int]:
    """Train the candidates the policy lists (method x seed) on top of the champion; returns the
    ids of their active candidate versions (retired ones are never candidates again)."""
    from registry import ensure_dataset, get_version

    log = get_run_logger()
    skill = skill_set(cycle.skill)
    dataset_id = ensure_dataset(cycle.ledger, skill.dataset_name, skill.split, skill.sha256)
    versions: list[int] = []
    for method, seed, run_config, variant, key in planned_runs(cycle, skill):
        run_id, status = open_training_run(cycle, method, seed, run_config, variant, key, dataset_id, skill.sha256)
        run_dir = cycle.platform.state / "runs" / cycle.skill.name / f"{method}-s{seed}-{key[:12]}"
        if status == "finished":
            log.info(f"{method} seed {seed}: training run {run_id} already finished; reusing its checkpoints")
            checkpoints = []
        else:
            checkpoints = train_run(cycle, run_id, run_config, variant, skill, run_dir)
        versions += reconcile_checkpoints(cycle, run_id, checkpoints)
    return [v for v in versions if get_version(cycle.ledger, v).status == "active"]
