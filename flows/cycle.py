"""The in-memory state of one update cycle, and how a version is applied to the backbone.

A `Cycle` holds what every stage shares: the configs, the opened platform, the loaded
backbone, the ledger ids of backbone / model / base version, the atlases, and the
per-domain KL caches (built once, reused for every candidate and reference).

Versions are applied without copying the model: a residual is attached as a forward hook
(generation) or added to the cached layer-l states (KL); a Weight-LoRA is installed into
layer l and removed afterwards, and its KL runs from a prefix cache that ends at l - 1.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .config import UpdateConfig
from .platform import Platform
from .policy import ReleasePolicy


@dataclass
class Cycle:
    config: UpdateConfig
    policy: ReleasePolicy
    platform: Platform
    flow_run_id: Optional[str] = None
    backbone: object = None  # atlas_core.backbone.Backbone
    layer: int = -1
    backbone_id: int = 0
    model: object = None  # registry.ModelInfo
    base: object = None  # registry.VersionInfo of the unmodified backbone
    atlases: dict = field(default_factory=dict)  # atlas sha256 -> Atlas
    atlas_ids: dict = field(default_factory=dict)  # atlas variant -> (ledger atlas id, Atlas, local path)
    kl_sets: dict = field(default_factory=dict)  # (domain, prefix layer) -> RetainedKL
    references: dict = field(default_factory=dict)  # (version id, domain) -> reference final hidden states

    @property
    def ledger(self):
        return self.platform.ledger

    @property
    def cache_dir(self) -> Path:
        return self.platform.state / "cache"


def fetch_verified(cycle: Cycle, sha256: str, manifest_sha256: str, name: str) -> Path:
    """A stored tensor file with its manifest, copied (verified) into the local cache."""
    folder = cycle.cache_dir / "artifacts" / sha256[:16]
    path = folder / f"{name}.safetensors"
    if not path.exists():
        cycle.platform.store.fetch(manifest_sha256, path.with_suffix(".json"))
        cycle.platform.store.fetch(sha256, path)
    return path


def adapter_file(cycle: Cycle, version) -> Path:
    from registry import get_version

    from .ledger_ops import run_checkpoints

    v = get_version(cycle.ledger, version) if isinstance(version, int) else version
    metrics = {cid: m for cid, _, _, m in run_checkpoints(cycle.ledger, v.training_run_id)}[v.checkpoint_id]
    return fetch_verified(cycle, v.adapter_sha256, metrics["manifest_sha256"], "adapter")


@dataclass
class Applied:
    """A version ready to evaluate: `residual` (at layer l) or `lora_path`, or neither (the base)."""

    version: object
    residual: object = None
    lora_path: Optional[Path] = None

    @contextmanager
    def on_model(self, model):
        """The backbone behaving as this version (for generation and choice)."""
        from atlas_core.residual import attach
        from atlas_core.train import WeightLoRA

        if self.residual is not None:
            with attach(model, self.residual):
                yield
        elif self.lora_path is not None:
            lora = WeightLoRA.load(self.lora_path, model)
            try:
                yield
            finally:
                lora.remove()
        else:
            yield


def apply_version(cycle: Cycle, version) -> Applied:
    from atlas_core.residual import load_adapter

    if version.is_base:
        return Applied(version)
    path = adapter_file(cycle, version)
    kind = json.loads(path.with_suffix(".json").read_text()).get("kind")
    if kind == "weight-lora":
        return Applied(version, lora_path=path)
    atlas = None
    if version.atlas_id is not None:
        atlas = cycle.atlases.get(version.atlas_sha256)
        if atlas is None:  # e.g. a champion trained before the atlas settings changed
            from atlas_core.atlas import Atlas

            from .ledger_ops import atlas_files

            atlas = Atlas.load(fetch_verified(cycle, *atlas_files(cycle.ledger, version.atlas_id), "atlas"))
            cycle.atlases[atlas.sha256] = atlas
    return Applied(version, residual=load_adapter(path, atlas))


def kl_set(cycle: Cycle, domain: str, layer: int):
    """The retained contexts of a domain with their frozen prefix ending at `layer` (built once)."""
    from evaluation.contexts import retained_contexts
    from evaluation.kl import RetainedKL

    key = (domain, layer)
    if key not in cycle.kl_sets:
        bb = cycle.backbone
        _, texts = retained_contexts(bb.tokenizer, domain, limit=cycle.config.retained.kl_contexts)
        cycle.kl_sets[key] = RetainedKL(bb.model, bb.tokenizer, texts, layer,
                                        max_length=cycle.config.retained.kl_max_tokens, progress=False)
    return cycle.kl_sets[key]


@torch.no_grad()
def final_hidden(cycle: Cycle, applied: Applied, domain: str) -> list:
    """The version's final hidden states on the domain's contexts (a KL reference)."""
    if applied.lora_path is None:
        return kl_set(cycle, domain, cycle.layer).reference(applied.residual)
    with applied.on_model(cycle.backbone.model):
        return kl_set(cycle, domain, cycle.layer - 1).reference(None)


def reference(cycle: Cycle, applied: Applied, domain: str) -> list:
    key = (applied.version.id, domain)
    if key not in cycle.references:
        cycle.references[key] = final_hidden(cycle, applied, domain)
    return cycle.references[key]


@torch.no_grad()
def retained_kl(cycle: Cycle, applied: Applied, ref: list, domain: str) -> float:
    """Mean KL(p_ref || p_version) in nats/token over the domain's contexts."""
    if applied.lora_path is None:
        return kl_set(cycle, domain, cycle.layer).kl(ref, applied.residual).mean
    with applied.on_model(cycle.backbone.model):
        return kl_set(cycle, domain, cycle.layer - 1).kl(ref, None).mean
