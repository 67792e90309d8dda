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
from typing import Optional

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from atlas_core.errors import InputError

from .config import digest, resolve
from .cycle import CycleContext
from .platform import PlatformRef
from .resources import Resources, scope
from .retries import transient_only
from .skills import SkillSet, skill_files, skill_set


def run_config_for(ctx: CycleContext, method: str, seed: int):
    """configs/train/<method>.yaml with this cycle's backbone, layer, atlas, seed and overrides;
    returns (run config, atlas variant or None)."""
    from atlas_core.methods import method_for
    from atlas_core.train import load_run_config

    over = ctx.config.train
    path = resolve(Path(over.configs_dir) / f"{method}.yaml")
    if not path.is_file():
        raise InputError(f"candidates.methods: no run config {path} for method {method!r}")
    rc = load_run_config(path)
    changes = {
        k: getattr(over, k)
        for k in ("epochs", "lr", "batch_size", "max_length", "on_bad_example", "checkpoint_every_steps")
        if getattr(over, k) is not None
    }
    train = replace(rc.train, seed=seed, **changes)
    variant = method_for(rc).atlas_variant  # None: the method routes with no atlas
    atlas = ctx.atlas(variant)
    return replace(
        rc, backbone=ctx.backbone.name, layer=ctx.layer, atlas=atlas.path if atlas else None, train=train
    ), variant


def run_key(ctx: CycleContext, method: str, run_config, variant, skill: SkillSet) -> str:
    atlas, bb, data = ctx.atlas(variant), ctx.backbone, ctx.config.data
    key = {
        "backbone": bb.name,
        "revision": bb.revision,
        "dtype": bb.dtype,
        "method": method,
        "config": run_config.to_dict() | {"atlas": atlas.sha256 if atlas else None},
        "data": [
            skill.dataset_name,
            skill.sha256,
            data.train_limit,
            data.val_limit,
            ctx.config.retained.replay_examples,
        ],
    }
    if skill.split.startswith("train[holdout"):  # keys of runs with a val_source stay as they were before holdouts
        key["split"] = skill.split
    if ctx.champion_id is not None:  # keys of runs on the bare backbone stay as they were before chains
        key["parent"] = [ctx.champion_id, ctx.champion.version.adapter_sha256]
    return digest(key)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def open_training_run(
    ctx: CycleContext, method: str, seed: int, run_config, variant, key: str, dataset_id: int, skill_sha256: str
) -> tuple[int, str]:
    """(training run id, status): the run with this key, or a new one."""
    from registry import end_mlflow_run, find_training_run

    with scope(ctx.platform) as res:
        db, p = res.ledger, res.platform
        found = find_training_run(db, ctx.backbone.ledger_id, ctx.skill.name, method, seed, key, model_id=ctx.model.id)
        if found is None:
            run_id = _start_run(db, p.store, ctx, method, seed, run_config, variant, key, dataset_id, skill_sha256)
            found = (run_id, "running")
        if found[1] != "finished":  # new, interrupted or failed before: it runs (again) now
            end_mlflow_run(db, p.bridge, found[0], "running")
        return found


def _start_run(db, store, ctx: CycleContext, method, seed, run_config, variant, key, dataset_id, skill_sha256) -> int:
    """A new training run row, with the skill's files kept in the store by content."""
    from registry import start_training_run

    # The skill's files are kept by content: later cycles read a released skill from them even
    # after its snapshot was pruned or overwritten (flows.skills.pinned_spec).
    kept = {k: store.put_file(path).sha256 for k, path in skill_files(ctx.skill).items()}
    config = {
        "run_key": key,
        "run_config": run_config.to_dict() | {"atlas": None},
        "skill": ctx.skill.to_dict(),
        "skill_sha256": skill_sha256,
        "skill_files": kept,
    }
    atlas = ctx.atlas(variant)
    return start_training_run(
        db,
        ctx.backbone.ledger_id,
        ctx.skill.name,
        method,
        seed,
        config,
        atlas_id=atlas.atlas_id if atlas else None,
        dataset_id=dataset_id,
        flow_run_id=ctx.flow_run_id,
        model_id=ctx.model.id,
        parent_version_id=ctx.champion.version.id,
    )


def record_checkpoint_files(res: Resources, evaluate: str, training_run_id: int, path: Path) -> int:
    """Store a checkpoint's adapter (+ manifest), record and log it, register it if it is a candidate
    (`evaluate`: the config's which-checkpoints setting)."""
    from atlas_core.train import read_state
    from registry import log_checkpoint, record_checkpoint, register_version, run_checkpoints

    db, state, store = res.ledger, read_state(path), res.platform.store
    adapter, manifest = store.put_file(path / "adapter.safetensors"), store.put_file(path / "adapter.json")
    known = {step for _, _, step, _ in run_checkpoints(db, training_run_id)}
    metrics = {
        "train_loss": state["train_losses"][-1] if state["train_losses"] else None,
        "val_loss": state["val_losses"].get(str(state["step"])),
        "epoch_end": bool(state.get("epoch_end")),
        "manifest_sha256": manifest.sha256,
    }
    ckpt = record_checkpoint(db, training_run_id, state["epoch"], state["step"], adapter, metrics)
    if state["step"] not in known:
        log_checkpoint(db, res.platform.bridge, ckpt.id)
    if (state.get("epoch_end") and evaluate == "epoch-ends") or evaluate == "all":
        return register_version(db, ckpt.id).id
    return 0  # "final": registered once the run is finished (reconcile_checkpoints)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def train_run(
    ctx: CycleContext, training_run_id: int, run_config, variant, skill: SkillSet, run_dir: Path
) -> list[str]:
    """Train (resuming if the folder has checkpoints); each new checkpoint is recorded at once."""
    from atlas_core.train import build_adapter, prepare_data, train
    from evaluation.contexts import retained_contexts

    with scope(ctx.platform) as res:
        tokenizer, tc = res.backbone(ctx.backbone).tokenizer, run_config.train
        retained = (
            retained_contexts(tokenizer, "gsm8k", split="train", limit=ctx.config.retained.replay_examples)[1]
            if tc.objective.uses_retained
            else None
        )
        data = prepare_data(tokenizer, skill.train, tc, val=skill.val or None, retained=retained)
        atlas = res.atlas_file(ctx.atlas(variant).path) if variant else None
        record = lambda path, _: record_checkpoint_files(res, ctx.config.evaluate, training_run_id, path)
        with res.applied_on(ctx, ctx.champion) as model:  # the parent's chain, frozen: the delta learns on top
            stats = retained_stats_for(res, ctx, run_config, model, tokenizer)
            adapter = build_adapter(run_config, model, atlas, stats)
            try:
                summary = train(model, adapter, data, tc, run_dir, resume=True, on_checkpoint=record)
            finally:
                if hasattr(adapter, "remove"):  # Weight-LoRA lives inside the model; take it out again
                    adapter.remove()
        return summary.checkpoints


def retained_stats_for(res: Resources, ctx: CycleContext, run_config, model, tokenizer):
    """The retained o_proj statistics a baseline needs (LoRA-Null, O-LoRA, CorDA-KPM), on the
    champion over the atlas's calibration contexts; None for methods that need none."""
    import torch

    from atlas_core.methods import method_for
    from atlas_core.train.retained_stats import retained_stats

    from .refresh import atlas_plan
    from .retained import calibration_texts

    lora = run_config.lora
    if not method_for(run_config).needs_stats(run_config) or lora.stats is not None:
        return None
    plan = atlas_plan(ctx, "local", tokenizer)  # the same contexts, per member, as the atlas's calibration
    texts = [t for m, info in plan["data"].items() for t in calibration_texts(ctx, m, info["examples"], tokenizer)]
    seqs = [
        torch.tensor(tokenizer(t, truncation=True, max_length=ctx.config.retained.kl_max_tokens)["input_ids"])
        for t in texts
    ]
    return retained_stats(model, ctx.layer, seqs, backbone=ctx.backbone.name, cache_dir=res.state / "retained-stats")


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def reconcile_checkpoints(
    platform: PlatformRef, evaluate: str, training_run_id: int, checkpoints: list[str], end: bool = True
) -> list[int]:
    """Record any checkpoint a crash left unrecorded, end the run (`end`: it just trained; a reused
    finished run keeps its finish time); return the run's candidate version ids."""
    from registry import end_mlflow_run

    with scope(platform) as res:
        for path in checkpoints:
            if Path(path).is_dir():
                record_checkpoint_files(res, evaluate, training_run_id, Path(path))
        if end:
            end_mlflow_run(res.ledger, res.platform.bridge, training_run_id, "finished")
        return candidate_versions(res.ledger, training_run_id, evaluate)


def candidate_versions(db, training_run_id: int, evaluate: str) -> list[int]:
    """The run's candidate versions under the config's which-checkpoints setting `evaluate` (every
    checkpoint, the epoch ends, or the final one), registered once (idempotent)."""
    from registry import register_version, run_checkpoints

    recorded = run_checkpoints(db, training_run_id)
    eligible = [
        cid for cid, _, _, m in recorded if evaluate == "all" or (evaluate == "epoch-ends" and m.get("epoch_end"))
    ]
    if evaluate == "final" and recorded:
        eligible = [recorded[-1][0]]
    return [register_version(db, cid).id for cid in eligible]


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def end_training_run(platform: PlatformRef, training_run_id: int, status: str, failure: Optional[str] = None) -> None:
    from registry import end_mlflow_run

    with scope(platform) as res:
        end_mlflow_run(res.ledger, res.platform.bridge, training_run_id, status, failure)


def planned_run(ctx: CycleContext, skill: SkillSet, method: str, seed: int) -> tuple[object, object, str]:
    """(run config, atlas variant, run key) of one candidate of the policy."""
    run_config, variant = run_config_for(ctx, method, seed)
    return run_config, variant, run_key(ctx, method, run_config, variant, skill)


def planned_runs(ctx: CycleContext, skill: SkillSet) -> list[tuple[str, int, object, object, str]]:
    """(method, seed, run config, atlas variant, run key) of every candidate the policy lists."""
    c = ctx.policy.candidates
    return [(m, s, *planned_run(ctx, skill, m, s)) for m in c.methods for s in c.seeds]


def failure_reason(error: BaseException) -> str:
    """How a failure is recorded: the exception's type and message, on one line."""
    return " ".join(f"{type(error).__name__}: {error}".split())


@flow(name="train_candidate", validate_parameters=True)
def train_candidate(ctx: CycleContext, method: str, seed: int) -> list[int]:
    """Train one candidate (method, seed) on top of the champion, or resume it, or reuse it when its
    run already finished; returns its active candidate versions (retired ones are never candidates
    again). A training that raises is recorded failed with the reason before the error goes on."""
    from evaluation.timing import phase
    from registry import ensure_dataset, get_version

    with scope(ctx.platform) as res:
        skill = skill_set(ctx.skill)
        dataset_id = ensure_dataset(res.ledger, skill.dataset_name, skill.split, skill.sha256)
        run_config, variant, key = planned_run(ctx, skill, method, seed)
        run_id, status = open_training_run(ctx, method, seed, run_config, variant, key, dataset_id, skill.sha256)
        run_dir = res.state / "runs" / ctx.skill.name / f"{method}-s{seed}-{key[:12]}"
        checkpoints = []
        if status == "finished":
            get_run_logger().info(f"{method} seed {seed}: training run {run_id} already finished; reusing it")
        else:
            try:
                with phase(f"train {method} s{seed}"):
                    checkpoints = train_run(ctx, run_id, run_config, variant, skill, run_dir)
            except Exception as e:  # shown FAILED, with why, until a rerun resumes it from its last checkpoint
                end_training_run(ctx.platform, run_id, "failed", failure_reason(e))
                raise
        versions = reconcile_checkpoints(ctx.platform, ctx.config.evaluate, run_id, checkpoints, status != "finished")
        return [v for v in versions if get_version(res.ledger, v).status == "active"]


@flow(name="train_skill", validate_parameters=True)
def train_skill(ctx: CycleContext) -> list[int]:
    """Train every candidate the policy lists (method x seed), one after another; returns their
    active candidate versions. (A cycle runs each candidate as training + evaluation instead:
    flows/candidates.py.)"""
    c = ctx.policy.candidates
    return [v for m in c.methods for s in c.seeds for v in train_candidate(ctx, m, s)]
