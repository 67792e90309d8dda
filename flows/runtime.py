"""Process resources of the cycle stages, looked up by the plain values the stages pass.

A stage receives ids, names and sha256s (flows/cycle.py); what it computes with is heavy and
process-bound: the opened platform (ledger, store, MLflow), the loaded backbone, verified
deltas and atlases, retained-KL prefix caches and reference states, the CSQA choice prompts'
prefix states. Each is built on first use and kept, keyed by content, until the outermost
`session()` ends, so the stages of one cycle share one backbone and one prefix cache per
member without passing any mutable object between them.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from evaluation.timing import phase

_memo: dict[tuple, object] = {}
_depth = 0


def _cached(key: tuple, build: Callable[[], object]):
    if key not in _memo:
        _memo[key] = build()
    return _memo[key]


@contextmanager
def session():
    """Resources live until the outermost session ends (then the ledger is closed and the
    backbone freed); sessions nest, so a stage run alone or inside `update` behaves the same."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            close()


def close() -> None:
    for key, value in list(_memo.items()):
        if key[0] == "platform":
            value.close()
    _memo.clear()


# ------------------------------------------------------------------------------ records
def platform():
    """The platform of the current environment (flows.platform.open_platform), opened once."""
    from atlas_core.paths import state_dir

    from .platform import open_platform

    env = tuple(os.environ.get(k) for k in ("ATLAS_LEDGER_URL", "ATLAS_ARTIFACT_STORE", "ATLAS_MLFLOW_TRACKING_URI"))
    return _cached(("platform", str(state_dir()), env), open_platform)


def ledger():
    return platform().ledger


def fetch_verified(sha256: str, manifest_sha256: str, name: str) -> Path:
    """A stored tensor file with its manifest, copied (verified) into the local cache."""
    p = platform()
    path = p.state / "cache" / "artifacts" / sha256[:16] / f"{name}.safetensors"
    if not path.exists():
        p.store.fetch(manifest_sha256, path.with_suffix(".json"))
        p.store.fetch(sha256, path)
    return path


# ------------------------------------------------------------------------------ model
def load_backbone(name: str, dtype: str):
    """The loaded backbone (flows.components.load_model); also found later by its resolved dtype."""
    from .components import load_model

    def build():
        with phase("backbone load"):
            return load_model(name, dtype)

    bb = _cached(("backbone", name, dtype), build)
    _memo.setdefault(("backbone", name, bb.dtype), bb)
    return bb


def backbone(ref):
    """The backbone of a flows.cycle.BackboneRef."""
    return load_backbone(ref.name, ref.dtype)


def scorer(spec):
    """The target scorer of a flows.skills.SkillSpec (built once per spec)."""
    from .components import json_dumps, make_scorer

    return _cached(("scorer", json_dumps(spec.target)), lambda: make_scorer(spec.target))


def atlas_file(path: str):
    """An atlas file, loaded (and verified) once; also found later by its sha256 (stored_atlas)."""
    from atlas_core.atlas import Atlas

    atlas = _cached(("atlas-file", str(path)), lambda: Atlas.load(path))
    return _memo.setdefault(("atlas", atlas.sha256), atlas)


def stored_atlas(atlas_id: int, sha256: str):
    """A recorded atlas by its file's sha256 (e.g. the one a parent release was trained with)."""
    from registry import atlas_files

    key = ("atlas", sha256)
    if key not in _memo:
        atlas_file(str(fetch_verified(*atlas_files(ledger(), atlas_id), "atlas")))
    return _memo[key]


def delta(version):
    """The one delta a version (registry.VersionInfo) adds to its parent, fetched and verified."""
    from atlas_core.chain import load_delta
    from registry import LedgerError, run_checkpoints

    def build():
        recorded = {cid: m for cid, _, _, m in run_checkpoints(ledger(), version.training_run_id)}
        if version.checkpoint_id not in recorded or "manifest_sha256" not in recorded[version.checkpoint_id]:
            raise LedgerError(
                f"version {version.name} (id {version.id}): checkpoint {version.checkpoint_id} and its "
                f"manifest are not recorded in training run {version.training_run_id}"
            )
        path = fetch_verified(version.adapter_sha256, recorded[version.checkpoint_id]["manifest_sha256"], "adapter")
        return load_delta(path, lambda sha: stored_atlas(version.atlas_id, sha) if version.atlas_id else None)

    return _cached(("delta", version.adapter_sha256), build)


def chain(applied):
    """The atlas_core.chain.Chain of a flows.cycle.Applied, every delta verified."""
    from atlas_core.chain import Chain

    return Chain([delta(v) for v in applied.deltas])


@contextmanager
def applied_on(ctx, applied):
    """The cycle's backbone behaving as this version (generation, choice, KL, scoring)."""
    model = backbone(ctx.backbone).model
    with chain(applied).attached(model):
        yield model


# ------------------------------------------------------------------------------ retained KL
def gate_texts(ctx, member: str) -> list[str]:
    """A member's retained-KL contexts (flows.retained.gate_texts), rendered once per spec."""
    from . import retained
    from .components import json_dumps

    key = (
        "gate_texts",
        ctx.backbone.name,
        json_dumps([retained.member_spec(ctx, member), ctx.config.retained.kl_contexts]),
    )
    return _cached(key, lambda: retained.gate_texts(ctx, member))


def _kl_key(ctx, member: str) -> tuple:
    from .config import digest

    r, bb = ctx.config.retained, ctx.backbone
    return ("kl", bb.name, bb.revision, bb.dtype, ctx.kl_layer, r.kl_max_tokens, digest(gate_texts(ctx, member)))


_KEEP_STATES = 32  # stored state files kept (newest first); one is ~45 MB for 128 contexts of SmolLM2 in bf16


def _layout(batched) -> str:
    """The batches' shapes (a RetainedKL's or a ChoiceSet's: token ids first in each batch): stored
    states are only valid for the same batching of the same tokens."""
    return str([tuple(batch[0].shape) for batch in batched.batches])


def _stored_states(key: tuple, build: Callable[[], list]) -> list:
    """Hidden states (one tensor per batch) kept on disk by a digest of `key`, so that a later
    process (the next cycle, a rerun) reads them instead of recomputing; verified when read."""
    from atlas_core.io import IntegrityError, load_verified, save_verified

    from .config import digest

    folder = platform().state / "cache" / "kl-states"
    path = folder / f"{digest([str(k) for k in key])}.safetensors"
    if path.is_file():
        try:
            tensors, _ = load_verified(path, kind="kl-states")
            return [tensors[f"batch.{i}"] for i in range(len(tensors))]
        except IntegrityError:
            pass  # damaged: computed again below and replaced
    states = build()
    save_verified(
        path, {f"batch.{i}": h for i, h in enumerate(states)}, {"kind": "kl-states", "key": [str(k) for k in key]}
    )
    for old in sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)[_KEEP_STATES:]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
    return states


def kl_set(ctx, member: str):
    """A member's gating contexts with their frozen prefix states (built before any delta is
    attached, so the cache holds the base model's states), keyed by the texts themselves."""
    from evaluation.kl import RetainedKL

    def build():
        bb = backbone(ctx.backbone)
        kl = RetainedKL(
            bb.model,
            bb.tokenizer,
            gate_texts(ctx, member),
            ctx.kl_layer,
            max_length=ctx.config.retained.kl_max_tokens,
            progress=False,
        )
        if ctx.kl_layer >= 0:  # -1: a delta changes layer 0, whole forwards (evaluation.kl)
            with phase(f"KL {member} (prefix states)"):
                kl.use_prefix(_stored_states(("prefix", *_kl_key(ctx, member), _layout(kl)), kl.prefix))
        return kl

    return _cached(_kl_key(ctx, member), build)


@torch.no_grad()
def reference(ctx, applied, member: str) -> list:
    """The version's final hidden states on a member's contexts (a KL reference)."""
    kl = kl_set(ctx, member)

    key = ("reference", *_kl_key(ctx, member), *(v.adapter_sha256 for v in applied.deltas))

    def build():
        with applied_on(ctx, applied):
            return kl.reference(None)

    dev = next(kl.model.parameters()).device
    return _cached(key, lambda: [h.to(dev) for h in _stored_states((*key, _layout(kl)), build)])


@torch.no_grad()
def retained_kl(ctx, applied, ref_applied: list, member: str) -> list:
    """KL(p_ref || p_version) on the member's contexts for each reference version in `ref_applied`,
    as evaluation.kl.KLResult: the mean in nats/token and each context's own, in the order of
    gate_texts(ctx, member) (one pass over the version; equal references measured once)."""
    kl = kl_set(ctx, member)
    with phase(f"KL {member}"):
        refs = [reference(ctx, r, member) for r in ref_applied]
        with applied_on(ctx, applied):
            return kl.kl_many(refs, None)


# ------------------------------------------------------------------------------ CSQA choice
def prefix_serves(ctx, applied) -> bool:
    """Whether the base model's states at layer ctx.kl_layer are this version's too: its chain
    changes nothing at or below that layer (the base; a version whose deltas all sit above it)."""
    return ctx.kl_layer >= 0 and (applied.lowest_layer is None or applied.lowest_layer > ctx.kl_layer)


def choice_set(ctx, prompts: list[str]):
    """The CSQA choice prompts batched once, with the base model's layer-kl_layer states (built
    before any delta is attached; stored on disk like the KL's, keyed by the prompts themselves)."""
    from evaluation.choice import ChoiceSet

    from .config import digest

    bb, r = ctx.backbone, ctx.config.retained
    key = ("choice", bb.name, bb.revision, bb.dtype, ctx.kl_layer, r.batch_size, digest(prompts))

    def build():
        loaded = backbone(bb)
        choices = ChoiceSet(loaded.model, loaded.tokenizer, prompts, batch_size=r.batch_size, layer=ctx.kl_layer)
        with phase("answers csqa (choice prefix states)"):
            choices.use_prefix(_stored_states(("prefix", *key, _layout(choices)), choices.prefix))
        return choices

    return _cached(key, build)


def csqa_answers(ctx, applied, batch_size: int | None = None) -> list:
    """A version's CSQA choice answers (evaluation.answers.Answer): from the stored prefix states
    when they are its own (prefix_serves), else by full forwards; full forwards in batches of
    `batch_size` when it is given (the noise floor, flows/noise_floor.py)."""
    from evaluation.choice import ChoiceSet
    from evaluation.tasks import csqa_choice_prompts

    bb, r = backbone(ctx.backbone), ctx.config.retained
    rows, prompts = csqa_choice_prompts(bb.tokenizer, limit=r.csqa_questions)
    choices = (
        choice_set(ctx, prompts)
        if batch_size is None and prefix_serves(ctx, applied)
        else ChoiceSet(bb.model, bb.tokenizer, prompts, batch_size=batch_size or r.batch_size)
    )
    with applied_on(ctx, applied), phase("answers csqa (choice)"):
        return choices.choose().answers(rows["id"], rows["answer"])


def resolve_applied(version):
    """A version (registry.VersionInfo) as a flows.cycle.Applied, every delta loaded and verified."""
    from registry import version_chain as chain_of

    from .cycle import Applied

    deltas = () if version.is_base else tuple(chain_of(ledger(), version.id))
    loaded = chain(Applied(version, deltas))
    return Applied(version, deltas, loaded.lowest_layer)
