"""squash_version: a line's chain of LoRA-family deltas as one candidate version (`atlas squash`).

    atlas squash --line L [--version champion] [--rank R] [--name N] [--domains gsm8k,csqa] [--contexts 32]
    atlas gate check NAME --config <the skill's update config> --policy configs/policy/squash.yaml --promote

Every release adds a delta to the chain, so a long line loads, hooks and decodes more deltas
with each one (bench/long_line.py). A chain of LoRA-family deltas (Weight-LoRA, submitted PEFT
LoRAs) is exactly one LoRA per Linear (atlas_core.squash): the squash is a new version on the
line's base that replaces the whole chain, exact by concatenating the factors or truncated to
`--rank` per module. Its KL vs the chain it replaces (mean KL(chain || squash) in nats/token on
each domain's retained contexts, whole forwards) is measured and printed before it is recorded.

It is recorded as a submitted adapter is (flows/submit.py: stored by sha256, a finished run with
one checkpoint, a version; the same squash again is the same version), teaching the squashed
version's skill, and its run keeps what it replaced (`squashed`: the version, its deltas by
sha256, the rank, the KL, and every skill spec the chain taught), so a promoted squash still
keeps the line's released skills in later cycles (flows/lineage.chain_skill_specs). It becomes
the champion only through the gate, like any candidate: `configs/policy/squash.yaml` asks for no
target gain and a tight KL vs the champion.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from atlas_core.errors import InputError
from evaluation.domains import BUILTIN_DOMAINS


@dataclass(frozen=True)
class Squashed:
    model: str  # the line's registered model
    version: str  # the squash, a candidate version on the base
    version_id: int
    source: str  # the version whose chain it replaces
    deltas: int  # that chain's length
    rank: Optional[int]  # per module; None: exact
    kl_vs_source: dict[str, float]  # domain -> mean KL(source || squash), nats/token
    modules: dict[str, dict] = field(default_factory=dict)  # module -> rank_in, rank_out, dropped
    new: bool = True  # False: this squash was recorded before


def squash_version(
    line: str,
    version: str = "champion",
    rank: Optional[int] = None,
    name: Optional[str] = None,
    domains: Sequence[str] = ("gsm8k", "csqa"),
    contexts: int = 32,
) -> Squashed:
    """Squash the chain of `version` of `line` into one delta and record it as a candidate."""
    from dataclasses import asdict

    from atlas_core.squash import squash_chain
    from registry import resolve_version

    from .lineage import taught_skills
    from .platform import PlatformRef
    from .resources import scope
    from .submit import _line, record_submitted

    if rank is not None and rank < 1:
        raise InputError(f"--rank: expected a positive integer, got {rank}")
    if contexts < 1:
        raise InputError(f"--contexts: expected a positive integer, got {contexts}")
    unknown = [d for d in domains if d not in BUILTIN_DOMAINS]
    if not domains or unknown:
        raise InputError(
            f"--domains: expected some of {', '.join(BUILTIN_DOMAINS)}, got {', '.join(domains) or 'none'}"
        )
    with scope(PlatformRef.from_environment()) as res, tempfile.TemporaryDirectory(prefix="atlas-squash-") as tmp:
        model = _line(res.ledger, line, None)
        if model is None:
            raise InputError(f"--line {line!r}: no such line")
        v = resolve_version(res.ledger, model.id, version)
        applied = res.resolve_applied(v)
        chain = res.chain(applied)
        _check_squashable(v, applied, chain, rank)
        bb = res.load_backbone(model.backbone, "float32")
        delta, modules = squash_chain(chain, bb.model, rank)
        path = Path(tmp) / "squash.safetensors"
        delta.save(path)
        kl = {d: kl_vs_chain(bb, chain, delta, d, contexts) for d in domains}
        what = {
            "version": v.name,
            "version_id": v.id,
            "deltas": [d.adapter_sha256 for d in applied.deltas],
            "rank": rank,
            "kl_vs_source": kl,
        }
        s = record_submitted(
            res,
            bb,
            model,
            str(path),
            line,
            parent="base",
            skill=v.skill,
            name=name,
            origin={"source": f"squash of {v.name}", "format": "squash"},
            run_config={"squashed": what | {"skills": taught_skills(res.ledger, applied)}},
        )
    return Squashed(
        s.model,
        s.version,
        s.version_id,
        v.name,
        len(applied.deltas),
        rank,
        kl,
        {m: asdict(r) for m, r in modules.items()},
        s.new,
    )


def _check_squashable(v, applied, chain, rank: Optional[int]) -> None:
    """Only LoRA-family deltas fold into one LoRA; an exact squash of one delta would change nothing."""
    from atlas_core import methods

    if not applied.deltas:
        raise InputError(f"--version: {v.name} is the base (no delta to squash)")
    if len(applied.deltas) == 1 and rank is None:
        raise InputError(f"--version: {v.name} has one delta; an exact squash would be the same delta (give --rank)")
    for version, delta in zip(applied.deltas, chain.deltas):
        fmt = methods.format_of(delta)
        if fmt.peft_method != "lora":
            raise InputError(
                f"--version: {v.name}'s chain holds {version.name}, a delta of kind {fmt.kind!r}, which is no "
                "plain LoRA; only chains of LoRA-family deltas (weight-lora, peft-lora) squash"
            )


@torch.no_grad()
def kl_vs_chain(bb, chain, delta, domain: str, contexts: int) -> float:
    """Mean KL(chain || squash) in nats/token on `contexts` of a retained domain, whole forwards."""
    from evaluation.contexts import retained_contexts
    from evaluation.kl import RetainedKL

    _, texts = retained_contexts(bb.tokenizer, domain, limit=contexts)
    kl = RetainedKL(bb.model, bb.tokenizer, texts, layer=-1, max_length=512, progress=False)
    with chain.attached(bb.model):
        reference = kl.reference()
    with delta.attached(bb.model):
        return kl.kl(reference).mean
