"""What a cycle's stages compute with, owned by one object that an entry point opens and closes.

A stage receives plain values (flows/cycle.py: ids, names, sha256s, and `ctx.platform`, a
PlatformRef saying where the ledger, store and MLflow are). What it computes *with* is heavy and
process-bound: the opened platform, the loaded backbone, verified deltas and atlases, retained-KL
prefix states and reference states, the CSQA choice prompts' prefix states. `Resources` holds them,
each kind in its own cache keyed by content (a typed key: names, revisions, sha256s), and closes
them when its scope ends:

    with scope(ctx.platform) as res:      # every Prefect flow/task body of the stages starts so
        model = res.backbone(ctx.backbone).model

The outermost `scope` opens the resources and makes them the current ones (a ContextVar, which
Prefect copies into its tasks and subflows); a nested scope on the same platform reuses them, so
the stages of one `update` share one backbone and one prefix cache per member, while a stage run
alone (or in another process, from its serialised inputs) opens and frees its own. Below the stage
bodies every function receives `res` as a parameter.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from evaluation.timing import phase

from .platform import Platform, PlatformRef, open_platform

# The resources of the innermost open scope: set only by `scope`, reset when it ends.
CURRENT: ContextVar[Optional["Resources"]] = ContextVar("atlas_resources", default=None)

_KEEP_STATES = 32  # stored state files kept (newest first); one is ~45 MB for 128 contexts of SmolLM2 in bf16


@contextmanager
def scope(ref: PlatformRef) -> Iterator["Resources"]:
    """The current resources when they are `ref`'s; otherwise opened here and closed on exit."""
    current = CURRENT.get()
    if current is not None and current.ref == ref:
        yield current
        return
    res = Resources(ref, open_platform(ref))
    token = CURRENT.set(res)
    try:
        yield res
    finally:
        CURRENT.reset(token)
        res.close()


# ------------------------------------------------------------------------------ typed cache keys
@dataclass(frozen=True)
class KLKey:
    """A member's gating contexts on one backbone, tokenised and cut the same way."""

    backbone: str
    revision: str
    dtype: str
    prefix_layer: int  # where the prefix states end (-1: none)
    max_tokens: int
    texts: str  # digest of the contexts themselves


@dataclass(frozen=True)
class ChoiceKey:
    """The CSQA choice prompts on one backbone, in one batching."""

    backbone: str
    revision: str
    dtype: str
    prefix_layer: int
    batch_size: int
    prompts: str  # digest of the prompts


class Resources:
    """The platform of one PlatformRef and every process resource built from it, each once."""

    def __init__(self, ref: PlatformRef, platform: Platform) -> None:
        self.ref = ref
        self.platform = platform
        self._backbones: dict[tuple[str, str], object] = {}  # (name, dtype asked or resolved) -> LoadedBackbone
        self._scorers: dict[str, object] = {}  # target spec (JSON) -> Scorer
        self._atlases: dict[str, object] = {}  # atlas file sha256 -> Atlas
        self._atlas_paths: dict[str, object] = {}  # local path -> Atlas
        self._deltas: dict[str, object] = {}  # adapter sha256 -> atlas_core.chain delta
        # (backbone, member spec, count) JSON -> (prompts, contexts)
        self._gate_texts: dict[str, tuple[list[str], list[str]]] = {}
        self._kl_sets: dict[KLKey, object] = {}  # -> evaluation.kl.RetainedKL with prefix states
        self._references: dict[tuple[KLKey, tuple[str, ...]], list] = {}  # (contexts, chain) -> final states
        self._choice_sets: dict[ChoiceKey, object] = {}  # -> evaluation.choice.ChoiceSet with prefix states

    def _caches(self) -> dict[str, dict]:
        return {name.removeprefix("_"): value for name, value in vars(self).items() if isinstance(value, dict)}

    def held(self) -> dict[str, int]:
        """How many resources of each kind are held now (kinds holding none left out)."""
        return {kind: len(cache) for kind, cache in self._caches().items() if cache}

    def close(self) -> None:
        """Close the ledger and drop every resource (the backbone's memory is freed with them)."""
        self.platform.close()
        for cache in self._caches().values():
            cache.clear()

    # -------------------------------------------------------------------------- records
    @property
    def ledger(self):
        return self.platform.ledger

    @property
    def state(self) -> Path:
        return self.platform.state

    def fetch_verified(self, sha256: str, manifest_sha256: str, name: str) -> Path:
        """A stored tensor file with its manifest, copied (verified) into the local cache."""
        path = self.state / "cache" / "artifacts" / sha256[:16] / f"{name}.safetensors"
        if not path.exists():
            self.platform.store.fetch(manifest_sha256, path.with_suffix(".json"))
            self.platform.store.fetch(sha256, path)
        return path

    # -------------------------------------------------------------------------- model
    def load_backbone(self, name: str, dtype: str):
        """The loaded backbone (flows.components.load_model); also found later by its resolved dtype."""
        from .components import load_model

        if (name, dtype) not in self._backbones:
            with phase("backbone load"):
                self._backbones[name, dtype] = load_model(name, dtype)
        bb = self._backbones[name, dtype]
        self._backbones.setdefault((name, bb.dtype), bb)
        return bb

    def backbone(self, ref):
        """The backbone of a flows.cycle.BackboneRef."""
        return self.load_backbone(ref.name, ref.dtype)

    def scorer(self, spec):
        """The target scorer of a flows.skills.SkillSpec (built once per spec)."""
        from .components import json_dumps, make_scorer

        key = json_dumps(spec.target)
        if key not in self._scorers:
            self._scorers[key] = make_scorer(spec.target)
        return self._scorers[key]

    def atlas_file(self, path: str):
        """An atlas file, loaded (and verified) once; also found later by its sha256 (stored_atlas)."""
        from atlas_core.atlas import Atlas

        if str(path) not in self._atlas_paths:
            self._atlas_paths[str(path)] = Atlas.load(path)
        atlas = self._atlas_paths[str(path)]
        return self._atlases.setdefault(atlas.sha256, atlas)

    def stored_atlas(self, atlas_id: int, sha256: str):
        """A recorded atlas by its file's sha256 (e.g. the one a parent release was trained with)."""
        from registry import atlas_files

        if sha256 not in self._atlases:
            self.atlas_file(str(self.fetch_verified(*atlas_files(self.ledger, atlas_id), "atlas")))
        return self._atlases[sha256]

    def delta(self, version):
        """The one delta a version (registry.VersionInfo) adds to its parent, fetched and verified."""
        from atlas_core.chain import load_delta
        from registry import LedgerError, run_checkpoints

        if version.adapter_sha256 in self._deltas:
            return self._deltas[version.adapter_sha256]
        recorded = {cid: m for cid, _, _, m in run_checkpoints(self.ledger, version.training_run_id)}
        if version.checkpoint_id not in recorded or "manifest_sha256" not in recorded[version.checkpoint_id]:
            raise LedgerError(
                f"version {version.name} (id {version.id}): checkpoint {version.checkpoint_id} and its "
                f"manifest are not recorded in training run {version.training_run_id}"
            )
        path = self.fetch_verified(
            version.adapter_sha256, recorded[version.checkpoint_id]["manifest_sha256"], "adapter"
        )
        atlas = (lambda sha: self.stored_atlas(version.atlas_id, sha)) if version.atlas_id else (lambda sha: None)
        self._deltas[version.adapter_sha256] = load_delta(path, atlas)
        return self._deltas[version.adapter_sha256]

    def chain(self, applied):
        """The atlas_core.chain.Chain of a flows.cycle.Applied, every delta verified."""
        from atlas_core.chain import Chain

        return Chain([self.delta(v) for v in applied.deltas])

    def resolve_applied(self, version):
        """A version (registry.VersionInfo) as a flows.cycle.Applied, every delta loaded and verified."""
        from registry import version_chain

        from .cycle import Applied

        deltas = () if version.is_base else tuple(version_chain(self.ledger, version.id))
        loaded = self.chain(Applied(version, deltas))
        return Applied(version, deltas, loaded.lowest_layer)

    @contextmanager
    def applied_on(self, ctx, applied):
        """The cycle's backbone behaving as this version (generation, choice, KL, scoring)."""
        model = self.backbone(ctx.backbone).model
        with self.chain(applied).attached(model):
            yield model

    # -------------------------------------------------------------------------- retained KL
    def gate_texts(self, ctx, member: str) -> list[str]:
        """A member's retained-KL contexts (flows.retained.gate_contexts), rendered once per spec."""
        return self._gate_prompts_and_texts(ctx, member)[1]

    def gate_prompts(self, ctx, member: str) -> list[str]:
        """The prompt each of the member's retained-KL contexts begins with (in gate_texts' order)."""
        return self._gate_prompts_and_texts(ctx, member)[0]

    def _gate_prompts_and_texts(self, ctx, member: str) -> tuple[list[str], list[str]]:
        from . import retained
        from .components import json_dumps

        spec = retained.member_spec(ctx, member)
        key = json_dumps([ctx.backbone.name, spec, ctx.config.retained.kl_contexts])
        if key not in self._gate_texts:
            self._gate_texts[key] = retained.gate_contexts(ctx, member, self.backbone(ctx.backbone).tokenizer)
        return self._gate_texts[key]

    def _kl_key(self, ctx, member: str) -> KLKey:
        from .config import digest

        bb = ctx.backbone
        texts = digest(self.gate_texts(ctx, member))
        return KLKey(bb.name, bb.revision, bb.dtype, ctx.kl_layer, ctx.config.retained.kl_max_tokens, texts)

    def _stored_states(self, key: tuple, build: Callable[[], list]) -> list:
        """Hidden states (one tensor per batch) kept on disk by a digest of `key`, so that a later
        process (the next cycle, a rerun) reads them instead of recomputing; verified when read."""
        from atlas_core.io import IntegrityError, load_verified, save_verified

        from .config import digest

        folder = self.state / "cache" / "kl-states"
        path = folder / f"{digest([str(k) for k in key])}.safetensors"
        if path.is_file():
            try:
                tensors, _ = load_verified(path, kind="kl-states")
                return [tensors[f"batch.{i}"] for i in range(len(tensors))]
            except IntegrityError:
                pass  # damaged: computed again below and replaced
        states = build()
        meta = {"kind": "kl-states", "key": [str(k) for k in key]}
        save_verified(path, {f"batch.{i}": h for i, h in enumerate(states)}, meta)
        for old in sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)[_KEEP_STATES:]:
            old.unlink(missing_ok=True)
            old.with_suffix(".json").unlink(missing_ok=True)
        return states

    def kl_set(self, ctx, member: str):
        """A member's gating contexts with their frozen prefix states (built before any delta is
        attached, so the cache holds the base model's states), keyed by the texts themselves."""
        from evaluation.kl import RetainedKL

        key = self._kl_key(ctx, member)
        if key in self._kl_sets:
            return self._kl_sets[key]
        bb = self.backbone(ctx.backbone)
        texts, limit = self.gate_texts(ctx, member), ctx.config.retained.kl_max_tokens
        prompts = self.gate_prompts(ctx, member)
        kl = RetainedKL(bb.model, bb.tokenizer, texts, ctx.kl_layer, max_length=limit, progress=False, prompts=prompts)
        if ctx.kl_layer >= 0:  # -1: a delta changes layer 0, whole forwards (evaluation.kl)
            with phase(f"KL {member} (prefix states)"):
                kl.use_prefix(self._stored_states(("prefix", *_kl_tuple(key), _layout(kl)), kl.prefix))
        self._kl_sets[key] = kl
        return kl

    @torch.no_grad()
    def reference(self, ctx, applied, member: str) -> list:
        """The version's final hidden states on a member's contexts (a KL reference)."""
        kl, key = self.kl_set(ctx, member), self._kl_key(ctx, member)
        chain = tuple(v.adapter_sha256 for v in applied.deltas)
        if (key, chain) not in self._references:

            def build():
                with self.applied_on(ctx, applied):
                    return kl.reference(None)

            dev = next(kl.model.parameters()).device
            stored = self._stored_states(("reference", *_kl_tuple(key), *chain, _layout(kl)), build)
            self._references[key, chain] = [h.to(dev) for h in stored]
        return self._references[key, chain]

    @torch.no_grad()
    def retained_kl(self, ctx, applied, ref_applied: list, member: str) -> list:
        """KL(p_ref || p_version) on the member's contexts for each reference version in `ref_applied`,
        as evaluation.kl.KLResult: the mean in nats/token and each context's own, in the order of
        gate_texts(ctx, member) (one pass over the version; equal references measured once)."""
        kl = self.kl_set(ctx, member)
        with phase(f"KL {member}"):
            refs = [self.reference(ctx, r, member) for r in ref_applied]
            with self.applied_on(ctx, applied):
                return kl.kl_many(refs, None)

    # -------------------------------------------------------------------------- CSQA choice
    def choice_set(self, ctx, prompts: list[str]):
        """The CSQA choice prompts batched once, with the base model's layer-kl_layer states (built
        before any delta is attached; stored on disk like the KL's, keyed by the prompts themselves)."""
        from evaluation.choice import ChoiceSet

        from .config import digest

        bb, r = ctx.backbone, ctx.config.retained
        key = ChoiceKey(bb.name, bb.revision, bb.dtype, ctx.kl_layer, r.batch_size, digest(prompts))
        if key not in self._choice_sets:
            loaded = self.backbone(bb)
            choices = ChoiceSet(loaded.model, loaded.tokenizer, prompts, batch_size=r.batch_size, layer=ctx.kl_layer)
            with phase("answers csqa (choice prefix states)"):
                stored_key = ("prefix", "choice", *_choice_tuple(key), _layout(choices))
                choices.use_prefix(self._stored_states(stored_key, choices.prefix))
            self._choice_sets[key] = choices
        return self._choice_sets[key]

    def csqa_answers(self, ctx, applied, batch_size: Optional[int] = None) -> list:
        """A version's CSQA choice answers (evaluation.answers.Answer): from the stored prefix states
        when they are its own (prefix_serves), else by full forwards; full forwards in batches of
        `batch_size` when it is given (the noise floor, flows/noise_floor.py)."""
        from evaluation.choice import ChoiceSet
        from evaluation.tasks import csqa_choice_prompts

        bb, r = self.backbone(ctx.backbone), ctx.config.retained
        rows, prompts = csqa_choice_prompts(bb.tokenizer, limit=r.csqa_questions)
        if batch_size is None and prefix_serves(ctx, applied):
            choices = self.choice_set(ctx, prompts)
        else:
            choices = ChoiceSet(bb.model, bb.tokenizer, prompts, batch_size=batch_size or r.batch_size)
        with self.applied_on(ctx, applied), phase("answers csqa (choice)"):
            return choices.choose().answers(rows["id"], rows["answer"])


def prefix_serves(ctx, applied) -> bool:
    """Whether the base model's states at layer ctx.kl_layer are this version's too: its chain
    changes nothing at or below that layer (the base; a version whose deltas all sit above it)."""
    return ctx.kl_layer >= 0 and (applied.lowest_layer is None or applied.lowest_layer > ctx.kl_layer)


def _layout(batched) -> str:
    """The batches' shapes (a RetainedKL's or a ChoiceSet's: token ids first in each batch): stored
    states are only valid for the same batching of the same tokens."""
    return str([tuple(batch[0].shape) for batch in batched.batches])


# The on-disk names of stored states are digests of these tuples; kept as they were, so state files
# written before the typed keys are found again (same order, same tags).
def _kl_tuple(key: KLKey) -> tuple:
    return ("kl", key.backbone, key.revision, key.dtype, key.prefix_layer, key.max_tokens, key.texts)


def _choice_tuple(key: ChoiceKey) -> tuple:
    return (key.backbone, key.revision, key.dtype, key.prefix_layer, key.batch_size, key.prompts)
