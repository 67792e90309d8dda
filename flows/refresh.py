"""refresh_atlas: reuse the stored atlas with the same content hash, or extract, fit, store, record.

The atlas describes the *champion's* layer-l activations on the retained set R (configured
domains + released skills, calibration rows only). Its content hash covers everything it is
a function of: backbone id and revision, dtype, layer, the champion's chain (its deltas'
sha256), each member's data (sha256) and how many examples of each, and the atlas config.
A new champion or a newly released skill therefore refits; otherwise the stored file is
fetched (sha256-verified) and loaded.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from .config import AtlasSpec, digest
from .cycle import AtlasRef, CycleContext
from .platform import PlatformRef
from .resources import scope
from .retries import transient_only


def atlas_plan(ctx: CycleContext, variant: str, tokenizer) -> dict:
    """What the atlas is a function of (hashed into its content hash)."""
    from .retained import calibration_rows, member_data, share_examples

    spec, members, bb = ctx.config.atlas, ctx.members, ctx.backbone
    rows = {m: calibration_rows(ctx, m, tokenizer) for m in members}
    examples = share_examples(math.ceil(spec.num_vectors / spec.per_example), rows)
    return {
        "backbone": bb.name,
        "revision": bb.revision,
        "dtype": bb.dtype,
        "layer": ctx.layer,
        "variant": variant,
        "config": asdict(spec),
        "champion_chain": [v.adapter_sha256 for v in ctx.champion.deltas],
        "data": {m: member_data(ctx, m) | {"examples": examples[m]} for m in members},
    }


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def find_stored_atlas(platform: PlatformRef, variant: str, content_hash: str) -> Optional[AtlasRef]:
    """The recorded atlas with this hash, fetched and verified, or None."""
    from registry import find_atlas

    with scope(platform) as res:
        info = find_atlas(res.ledger, content_hash)
        if info is None:
            return None
        path = res.fetch_verified(info.artifact_sha256, info.config["manifest_sha256"], "atlas")
        return AtlasRef(variant, info.id, res.atlas_file(str(path)).sha256, content_hash, str(path))


@task(cache_policy=NO_CACHE)
def extract_calibration(ctx: CycleContext, plan: dict) -> torch.Tensor:
    """The champion's layer-l activations on the calibration rows of R (only layers 0..l run)."""
    from atlas_core.extract import sample_activations

    from .retained import calibration_texts

    with scope(ctx.platform) as res:
        spec, tokenizer = ctx.config.atlas, res.backbone(ctx.backbone).tokenizer
        texts = [
            t
            for member, info in plan["data"].items()
            for t in calibration_texts(ctx, member, info["examples"], tokenizer)
        ]
        with res.applied_on(ctx, ctx.champion) as model:
            return sample_activations(model, tokenizer, texts, ctx.layer, spec.num_vectors, spec.per_example, spec.seed)


@task(cache_policy=NO_CACHE)
def fit_and_save(state: Path, spec: AtlasSpec, x: torch.Tensor, plan: dict, content_hash: str) -> Path:
    """The fitted atlas, saved under <state>/atlases."""
    from atlas_core.atlas import AtlasConfig, fit_atlas

    config = AtlasConfig(
        num_charts=spec.charts,
        rank=spec.rank,
        variant=plan["variant"],
        num_vectors=spec.num_vectors,
        per_example=spec.per_example,
        seed=spec.seed,
    )
    atlas = fit_atlas(x, config, meta={**plan, "content_hash": content_hash})
    path = Path(state) / "atlases" / f"{content_hash[:16]}-{plan['variant']}.safetensors"
    atlas.save(path)
    return path


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def store_and_record(
    platform: PlatformRef, backbone_id: int, layer: int, path: Path, plan: dict, content_hash: str
) -> AtlasRef:
    """Put the atlas and its manifest in the store, then record it (idempotent by content hash)."""
    from registry import ensure_dataset, record_atlas

    with scope(platform) as res:
        store, db = res.platform.store, res.ledger
        artifact, manifest = store.put_file(path), store.put_file(path.with_suffix(".json"))
        datasets = [
            ensure_dataset(db, info.get("dataset", m), "calibration", info["sha256"])
            for m, info in plan["data"].items()
        ]
        config = {**plan, "manifest_sha256": manifest.sha256}
        info = record_atlas(db, content_hash, backbone_id, layer, config, artifact, datasets)
        return AtlasRef(plan["variant"], info.id, res.atlas_file(str(path)).sha256, content_hash, str(path))


@flow(name="refresh_atlas", validate_parameters=True)
def refresh_atlas(ctx: CycleContext, variant: str = "local") -> AtlasRef:
    """The atlas of this backbone x layer x champion x retained data x config: reused when stored,
    else fitted on the champion's activations."""
    log = get_run_logger()
    with scope(ctx.platform) as res:
        plan = atlas_plan(ctx, variant, res.backbone(ctx.backbone).tokenizer)
        content_hash = digest(plan)
        found = find_stored_atlas(ctx.platform, variant, content_hash)
        if found is None:
            x = extract_calibration(ctx, plan)
            path = fit_and_save(str(res.state), ctx.config.atlas, x, plan, content_hash)
            found = store_and_record(ctx.platform, ctx.backbone.ledger_id, ctx.layer, path, plan, content_hash)
            log.info(f"atlas {variant}: fitted and stored (content hash {content_hash[:12]})")
        else:
            log.info(f"atlas {variant}: reused stored atlas {found.atlas_id} (content hash {content_hash[:12]})")
        return found
