"""The retained set R of a cycle: its members' gating texts, calibration texts and data hashes.

R = the configured retained domains (update config `retained.domains`) + every released
skill of the champion's chain other than the skill being trained (flows/skills.py).
Gating rows (retained KL, answers) and calibration rows (the atlas) never overlap: a
built-in domain gates on its evaluation split and calibrates on its training split; a
released skill gates on its held-out pairs and calibrates on its training pairs.
"""

from __future__ import annotations

from atlas_core.errors import InputError

from .cycle import CycleContext
from .skills import SkillSpec, skill_contexts, skill_set


def _released(ctx: CycleContext, member: str) -> SkillSpec | None:
    return next((s for s in ctx.released if s.name == member), None)


def _domain(ctx: CycleContext, member: str):
    """The configured domain spec (a built-in name or a JSONL file's mapping) called `member`."""
    return next(d for d in ctx.config.retained.domains if (d if isinstance(d, str) else d["name"]) == member)


def member_spec(ctx: CycleContext, member: str):
    """What defines the member's texts: a released skill's spec or the configured domain's."""
    spec = _released(ctx, member)
    return spec.to_dict() if spec is not None else _domain(ctx, member)


def _rendered(ctx: CycleContext, member: str, role: str, limit: int | None, tokenizer) -> tuple[list[str], list[str]]:
    """(prompts, texts) of the member's rows in `role`: each text is its prompt + the reference answer."""
    from evaluation.domains import domain_prompts

    spec = _released(ctx, member)
    if spec is not None:
        return skill_contexts(tokenizer, spec, role, limit)
    return domain_prompts(tokenizer, _domain(ctx, member), role, limit)[1:]


def _texts(ctx: CycleContext, member: str, role: str, limit: int | None, tokenizer) -> list[str]:
    return _rendered(ctx, member, role, limit, tokenizer)[1]


def gate_contexts(ctx: CycleContext, member: str, tokenizer) -> tuple[list[str], list[str]]:
    """(prompts, contexts): the member's retained-KL contexts (first `retained.kl_contexts` gating
    rows) rendered with the backbone's chat template, and the prompt each begins with (the KL's
    position kinds); flows.resources.Resources keeps them per spec."""
    return _rendered(ctx, member, "gate", ctx.config.retained.kl_contexts, tokenizer)


def calibration_texts(ctx: CycleContext, member: str, limit: int, tokenizer) -> list[str]:
    """The member's atlas calibration contexts (rows disjoint from its gating rows)."""
    return _texts(ctx, member, "calibration", limit, tokenizer)


def calibration_rows(ctx: CycleContext, member: str, tokenizer) -> int:
    """How many calibration rows the member has (built-in domains: their whole training split)."""
    spec = _released(ctx, member)
    if spec is not None:
        return len(skill_set(SkillSpec(spec.name, spec.data | {"train_limit": None}, spec.target)).train)
    domain = _domain(ctx, member)
    return 10**9 if isinstance(domain, str) else len(_texts(ctx, member, "calibration", None, tokenizer))


def share_examples(needed: int, available: dict[str, int]) -> dict[str, int]:
    """Split `needed` calibration examples evenly over the members; a member with fewer rows
    gives all it has and the others make up the difference."""
    out, left, open_members = {}, needed, sorted(available, key=lambda m: available[m])
    while open_members:
        fair = -(-left // len(open_members))  # ceil
        m = open_members.pop(0)
        out[m] = min(available[m], fair)
        left -= out[m]
    if left > 0:
        raise InputError(
            f"atlas.num_vectors: needs {needed} calibration examples, the retained set has only "
            f"{needed - left} ({available}); lower atlas.num_vectors or raise atlas.per_example"
        )
    return out


def member_data(ctx: CycleContext, member: str) -> dict:
    """What the member's texts are a function of (hashed into the atlas content hash)."""
    from evaluation.domains import domain_data_sha256

    spec = _released(ctx, member)
    if spec is not None:
        s = skill_set(spec)
        split = {"split": s.split} if s.split.startswith("train[holdout") else {}  # other keys stay as before
        return {"skill": spec.name, "dataset": s.dataset_name, "sha256": s.sha256, **split}
    domain = _domain(ctx, member)
    return {"domain": domain, "sha256": domain_data_sha256(domain)}
