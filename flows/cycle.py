"""The typed values the stages of an update cycle pass to each other.

Every stage of `update` (flows/update.py) takes and returns plain, frozen values: configs,
ledger records and ids. Nothing mutable is shared between stages, so each stage is a
Prefect (sub)flow with parameter validation that can be run and tested alone:

    resolve_lineage(config, policy)      -> CycleContext   backbone, line, base, champion chain, skills
    refresh_atlas(ctx, variant)          -> AtlasRef       the atlas of the champion on R
    run_candidates(ctx)                  -> list[CandidateRun]  each (method, seed): train_candidate, then
                                                            evaluate_candidate per version, here or on a work pool
    gate(ctx, candidates, failed)        -> GateOutcome    checks, decisions, selection
    promote(ctx, version_id, reason)     -> ReleaseInfo | None

What a stage computes *with* (the opened ledger/store/MLflow, the loaded backbone, verified
deltas, atlases, KL prefix caches) lives in flows/resources.py: `ctx.platform` names where the
records are, and each stage opens `scope(ctx.platform)` (reused when its caller already has it
open), so a stage run alone or in another process from these values gives the same record.

A version is applied as its whole chain (atlas_core.chain): every delta from the first
release to it, attached in order. Retained KL runs from a prefix cache that ends below the
lowest layer any delta touches, so one cache serves the base, the champion and every candidate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from registry import ModelInfo, VersionInfo

from .config import UpdateConfig
from .platform import PlatformRef
from .policy import ReleasePolicy
from .skills import SkillSpec


@dataclass(frozen=True)
class BackboneRef:
    """The backbone a cycle runs on, as recorded in the ledger."""

    name: str  # what the config asked for (alias, hub id or path)
    revision: str  # content identity (hub commit or sha256 of the shipped GGUF)
    dtype: str  # what the weights are: 'float32' or 'bfloat16' ('auto' resolved)
    ledger_id: int
    layer: int  # the layer l the atlas describes and residuals sit on


@dataclass(frozen=True)
class Applied:
    """A version as its chain of deltas, oldest first (no deltas: the base model)."""

    version: VersionInfo
    deltas: tuple[VersionInfo, ...] = ()
    lowest_layer: Optional[int] = None  # lowest decoder layer any delta changes; None for the base


@dataclass(frozen=True)
class AtlasRef:
    """A stored atlas: its ledger id, content identity and local (verified) file."""

    variant: str
    atlas_id: int
    sha256: str  # of the atlas file
    content_hash: str  # of what it is a function of (flows/refresh.py)
    path: str


@dataclass(frozen=True)
class CycleContext:
    """What every stage after `resolve_lineage` reads: the cycle's inputs and resolved lineage."""

    config: UpdateConfig
    policy: ReleasePolicy
    backbone: BackboneRef
    model: ModelInfo  # the line
    base: Applied  # the unmodified backbone's version
    champion: Applied  # the version holding `champion` (the base when nobody does)
    skill: SkillSpec  # what this cycle teaches
    platform: PlatformRef  # where the ledger, artifact store and MLflow are (flows/resources.py opens them)
    released: tuple[SkillSpec, ...] = ()  # skills of the champion's chain, minus `skill`
    atlases: tuple[AtlasRef, ...] = ()  # filled in by refresh_atlas, one per residual variant
    flow_run_id: Optional[str] = None
    lowest_candidate_layer: Optional[int] = None  # a submitted candidate's lowest changed layer (flows/gate_check.py)

    @property
    def layer(self) -> int:
        return self.backbone.layer

    @property
    def members(self) -> list[str]:
        """The retained set R: configured domains, then released skills other than the one trained."""
        return [*self.config.domain_names, *(s.name for s in self.released)]

    @property
    def kl_layer(self) -> int:
        """Where the KL prefix cache ends: below every layer a delta of this line changes
        (-1 when one changes layer 0: no prefix, evaluation.kl runs whole forwards)."""
        lowest = [v for v in (self.champion.lowest_layer, self.lowest_candidate_layer) if v is not None]
        return min([self.layer, *lowest]) - 1

    @property
    def champion_id(self) -> Optional[int]:
        """The version holding `champion`; None while nobody does (the base serves)."""
        return None if self.champion.version.is_base else self.champion.version.id

    def atlas(self, variant: Optional[str]) -> Optional[AtlasRef]:
        """The refreshed atlas of a residual variant (None for methods that use none)."""
        if variant is None:
            return None
        for ref in self.atlases:
            if ref.variant == variant:
                return ref
        raise KeyError(f"atlas variant {variant!r} was not refreshed this cycle")


@dataclass(frozen=True)
class CycleResult:
    """What one `update` cycle did: rendered by `atlas update` and the report, returned to Python."""

    model: str  # the line's registered model name
    outcome: str  # promoted | rejected | not-promoted (another cycle moved champion first) | idle
    champion: str  # the version holding `champion` after the cycle (the base's name while nobody does)
    previous_champion: str  # ... and before it
    state: str  # the state folder the records are in
    selected: Optional[str] = None  # the candidate the gate selected (also when it lost a race)
    candidates: dict[str, bool] = field(default_factory=dict)  # candidate -> passed the gate
    failed: dict[str, str] = field(default_factory=dict)  # candidate (method and seed) that did not finish -> why
    report: Optional[str] = None  # the cycle report's path (None when idle)
    reason: Optional[str] = None  # why the cycle was idle
    seconds: dict[str, float] = field(default_factory=dict)  # wall seconds per phase, in order
    steps: dict[str, float] = field(default_factory=dict)  # seconds per timed step (evaluation.timing)

    @property
    def promoted(self) -> bool:
        return self.outcome == "promoted"

    def to_dict(self) -> dict:
        return asdict(self) | {"promoted": self.promoted}


def load_cycle(
    config: str,
    policy: str,
    backbone: Optional[str] = None,
    skill: Optional[str] = None,
    line: Optional[str] = None,
    snapshot: Optional[str] = None,
) -> tuple[UpdateConfig, ReleasePolicy]:
    """The cycle's config and policy, validated (names the field or file on a mistake)."""
    from .config import load_update_config
    from .policy import load_cycle_policy
    from .skills import resolve_snapshot

    cfg = load_update_config(config, backbone=backbone, skill=skill, line=line)
    if snapshot is not None:
        resolve_snapshot(snapshot, "--snapshot")
        cfg = with_snapshot(cfg, snapshot)
    return cfg, load_cycle_policy(policy, cfg)


def with_snapshot(cfg: UpdateConfig, snapshot: str) -> UpdateConfig:
    """The config with `--snapshot` as its data source (validated as data.source is)."""
    from atlas_core.typed_config import ConfigError

    try:
        return replace(cfg, data=replace(cfg.data, source=snapshot))
    except ConfigError as e:
        raise ConfigError(f"--snapshot: {str(e).removeprefix('source: ')}") from None
