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

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from .config import digest
from .cycle import Cycle, fetch_verified


def atlas_plan(cycle: Cycle, variant: str) -> dict:
    """What the atlas is a function of (hashed into its content hash)."""
    from .retained import calibration_rows, member_data, share_examples

    spec, members = cycle.config.atlas, cycle.members
    examples = share_examples(math.ceil(spec.num_vectors / spec.per_example), {m: calibration_rows(cycle, m) for m in members})
    return {"backbone": cycle.backbone.name, "revision": cycle.backbone.revision, "dtype": cycle.backbone.dtype,
            "layer": cycle.layer, "variant": variant, "config": asdict(spec),
            "champion_chain": [v.adapter_sha256 for v in cycle.champion.deltas],
            "data": {m: member_data(cycle, m) | {"examples": examples[m]} for m in members}}



@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def find_stored_atlas(cycle: Cycle, content_hash: str):
    """The recorded atlas with this hash, fetched and verified, or None."""
    from atlas_core.atlas import Atlas
    from registry import find_atlas

    info = find_atlas(cycle.ledger, content_hash)
    if info is None:
        return None
    path = fetch_verified(cycle, info.artifact_sha256, info.config["manifest_sha256"], "atlas")
    return info.id, Atlas.load(path), path


@task(cache_policy=NO_CACHE)
def extract_calibration(cycle: Cycle, plan: dict):
    """The champion's layer-l activations on the calibration rows of R (only layers 0..l run)."""
    from atlas_core.extract import sample_activations

    from .retained import calibration_texts

    bb, spec = cycle.backbone, cycle.config.atlas
    texts = []
    for member, info in plan["data"].items():
        texts += calibration_texts(cycle, member, info["examples"])
    with cycle.champion.on_model(bb.model):
        return sample_activations(bb.model, bb.tokenizer, texts, cycle.layer, spec.num_vectors, spec.per_example, spec.seed)


@task(cache_policy=NO_CACHE)
def fit_and_save(cycle: Cycle, x, plan: dict, content_hash: str) -> Path:
    from atlas_core.atlas import AtlasConfig, fit_atlas

    spec = cycle.config.atlas
    config = AtlasConfig(num_charts=spec.charts, rank=spec.rank, variant=plan["variant"], num_vectors=spec.num_vectors,
                         per_example=spec.per_example, seed=spec.seed)
    atlas = fit_atlas(x, config, meta={**plan, "content_hash": content_hash})
    path = cycle.platform.state / "atlases" / f"{content_hash[:16]}-{plan['variant']}.safetensors"
    atlas.save(path)
    return path


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def store_and_record(cycle: Cycle, path: Path, plan: dict, content_hash: str):
    """Put the atlas and its manifest in the store, then record it (idempotent by content hash)."""
    from atlas_core.atlas import Atlas
    from registry import ensure_dataset, record_atlas

    store = cycle.platform.store
    artifact, manifest = store.put_file(path), store.put_file(path.with_suffix(".json"))
    datasets = [ensure_dataset(cycle.ledger, info.get("dataset", m), "calibration", info["sha256"])
                for m, info in plan["data"].items()]
    info = record_atlas(cycle.ledger, content_hash, cycle.backbone_id, cycle.layer,
                        {**plan, "manifest_sha256": manifest.sha256}, artifact, datasets)
    return info.id, Atlas.load(path), path


@flow(name="refresh_atlas", validate_parameters=False)
def refresh_atlas(cycle: Cycle, variant: str = "local") -> int:
    """The atlas of this backbone x layer x retained data x config: reused when stored, else fitted."""
    log = get_run_logger()
    plan = atlas_plan(cycle, variant)
    content_hash = digest(plan)
    found = find_stored_atlas(cycle, content_hash)
    if found is None:
        x = extract_calibration(cycle, plan)
        found = store_and_record(cycle, fit_and_save(cycle, x, plan, content_hash), plan, content_hash)
        log.info(f"atlas {variant}: fitted and stored (content hash {content_hash[:12]})")
    else:
        log.info(f"atlas {variant}: reused stored atlas {found[0]} (content hash {content_hash[:12]})")
    atlas_id, atlas, path = found
    cycle.atlases[atlas.sha256] = atlas
    cycle.atlas_ids[variant] = (atlas_id, atlas, path)
    return atlas_id
