"""The in-memory state of one update cycle, and how a version is applied to the backbone.

A `Cycle` holds what every stage shares: the configs, the opened platform, the loaded
backbone, the line (registered model) with its base and champion versions, the champion's
chain, the retained set, the atlases, and the per-member KL caches (built once, reused for
every candidate and reference).

A version is applied as its whole chain (atlas_core.chain): every delta from the first
release to it, loaded from the verified store and attached in order. Nothing is copied:
residuals are forward hooks, Weight-LoRAs frozen hooks on their Linear. Retained KL runs
from a prefix cache that ends below the lowest layer any delta touches, so one cache
serves the base, the champion and every candidate.
"""
from __future__ import annotations

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
    model: object = None  # registry.ModelInfo of the line
    base: object = None  # registry.VersionInfo of the unmodified backbone
    champion: object = None  # Applied: the version holding `champion` (the base when nobody does), chain loaded
    skill: object = None  # flows.skills.SkillSpec being taught
    released: list = field(default_factory=list)  # flows.skills.SkillSpec of the champion's chain, minus `skill`
    released_scorers: dict = field(default_factory=dict)  # released skill -> its target scorer
    atlases: dict = field(default_factory=dict)  # atlas sha256 -> Atlas
    atlas_ids: dict = field(default_factory=dict)  # atlas variant -> (ledger atlas id, Atlas, local path)
    kl_sets: dict = field(default_factory=dict)  # member name -> RetainedKL
    references: dict = field(default_factory=dict)  # (version id, member) -> reference final hidden states
    loaded: dict = field(default_factory=dict)  # version id -> loaded delta

    @property
    def ledger(self):
        return self.platform.ledger

    @property
    def cache_dir(self) -> Path:
        return self.platform.state / "cache"

    @property
    def members(self) -> list[str]:
        """The retained set R: configured domains, then released skills other than the one trained."""
        return [*self.config.domain_names, *(s.name for s in self.released)]

    @property
    def kl_layer(self) -> int:
        """Where the KL prefix cache ends: below every layer a delta of this line changes."""
        lowest = self.champion.chain.lowest_layer if self.champion is not None else None
        return min(self.layer, self.layer if lowest is None else lowest) - 1


def fetch_verified(cycle: Cycle, sha256: str, manifest_sha256: str, name: str) -> Path:
    """A stored tensor file with its manifest, copied (verified) into the local cache."""
    folder = cycle.cache_dir / "artifacts" / sha256[:16]
    path = folder / f"{name}.safetensors"
    if not path.exists():
        cycle.platform.store.fetch(manifest_sha256, path.with_suffix(".json"))
        cycle.platform.store.fetch(sha256, path)
    return path


def adapter_file(cycle: Cycle, version) -> Path:
    from registry import run_checkpoints

    metrics = {cid: m for cid, _, _, m in run_checkpoints(cycle.ledger, version.training_run_id)}[version.checkpoint_id]
    return fetch_verified(cycle, version.adapter_sha256, metrics["manifest_sha256"], "adapter")


def atlas_of(cycle: Cycle, atlas_id: int, sha256: str):
    from atlas_core.atlas import Atlas
    from registry import atlas_files

    if sha256 not in cycle.atlases:  # e.g. the atlas a parent release was trained with
        atlas = Atlas.load(fetch_verified(cycle, *atlas_files(cycle.ledger, atlas_id), "atlas"))
        cycle.atlases[atlas.sha256] = atlas
    return cycle.atlases[sha256]


def load_version_delta(cycle: Cycle, version):
    """The one delta a version adds to its parent, fetched and sha256-verified (cached per cycle)."""
    from atlas_core.chain import load_delta

    if version.id not in cycle.loaded:
        atlas = (lambda sha: atlas_of(cycle, version.atlas_id, sha)) if version.atlas_id is not None else (lambda sha: None)
        cycle.loaded[version.id] = load_delta(adapter_file(cycle, version), atlas)
    return cycle.loaded[version.id]


@dataclass
class Applied:
    """A version ready to evaluate: its chain of deltas (empty: the base model)."""

    version: object
    chain: object  # atlas_core.chain.Chain
    deltas: list = field(default_factory=list)  # registry.VersionInfo of the chain, oldest first

    @contextmanager
    def on_model(self, model):
        """The backbone behaving as this version (generation, choice, KL, scoring)."""
        with self.chain.attached(model):
            yield


def apply_version(cycle: Cycle, version) -> Applied:
    """A version with every delta of its chain loaded and verified, oldest first."""
    from atlas_core.chain import Chain
    from registry import version_chain

    chain = [] if version.is_base else version_chain(cycle.ledger, version.id)
    return Applied(version, Chain([load_version_delta(cycle, v) for v in chain]), chain)


def kl_set(cycle: Cycle, member: str):
    """The gating contexts of a retained member with their frozen prefix (built once, before any
    delta is attached, so the cache holds the base model's states)."""
    from evaluation.kl import RetainedKL

    from .retained import gate_texts

    if member not in cycle.kl_sets:
        bb = cycle.backbone
        texts = gate_texts(cycle, member)
        kl = RetainedKL(bb.model, bb.tokenizer, texts, cycle.kl_layer, max_length=cycle.config.retained.kl_max_tokens,
                        progress=False)
        kl.prefix()
        cycle.kl_sets[member] = kl
    return cycle.kl_sets[member]


@torch.no_grad()
def reference(cycle: Cycle, applied: Applied, member: str) -> list:
    """The version's final hidden states on a member's contexts (a KL reference), cached."""
    key = (applied.version.id, member)
    if key not in cycle.references:
        kl = kl_set(cycle, member)
        with applied.on_model(cycle.backbone.model):
            cycle.references[key] = kl.reference(None)
    return cycle.references[key]


@torch.no_grad()
def retained_kl(cycle: Cycle, applied: Applied, ref: list, member: str) -> float:
    """Mean KL(p_ref || p_version) in nats/token over the member's contexts."""
    kl = kl_set(cycle, member)
    with applied.on_model(cycle.backbone.model):
        return kl.kl(ref, None).mean
