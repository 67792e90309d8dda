"""The retained set R of a cycle: its members' gating texts, calibration texts and data hashes.

R = the configured retained domains (update config `retained.domains`) + every released
skill of the champion's chain other than the skill being trained (flows/skills.py).
Gating rows (retained KL, answers) and calibration rows (the atlas) never overlap: a
built-in domain gates on its evaluation split and calibrates on its training split; a
released skill gates on its held-out pairs and calibrates on its training pairs.
"""
from __future__ import annotations

from .cycle import Cycle
from .skills import SkillSpec, skill_set, skill_texts

# domain -> (gating split, calibration split, data file of each)
BUILTIN = {"gsm8k": ("test", "train", "gsm8k/test.jsonl", "gsm8k/train.jsonl"),
           "csqa": ("validation", "train", "csqa/dev_rand_split.jsonl", "csqa/train_rand_split.jsonl")}


def _released(cycle: Cycle, member: str) -> SkillSpec | None:
    return next((s for s in cycle.released if s.name == member), None)


def _domain_texts(cycle: Cycle, member: str, role: str, limit: int) -> list[str]:
    from evaluation.contexts import retained_contexts

    gate_split, calib_split, _, _ = BUILTIN[member]
    return retained_contexts(cycle.backbone.tokenizer, member, split=gate_split if role == "gate" else calib_split,
                             limit=limit)[1]


def gate_texts(cycle: Cycle, member: str) -> list[str]:
    """The member's retained-KL contexts (first `retained.kl_contexts` gating rows)."""
    limit = cycle.config.retained.kl_contexts
    spec = _released(cycle, member)
    if spec is not None:
        return skill_texts(cycle.backbone.tokenizer, spec, "gate", limit)
    return _domain_texts(cycle, member, "gate", limit)


def calibration_texts(cycle: Cycle, member: str, limit: int) -> list[str]:
    """The member's atlas calibration contexts (rows disjoint from its gating rows)."""
    spec = _released(cycle, member)
    if spec is not None:
        return skill_texts(cycle.backbone.tokenizer, spec, "calibration", limit)
    return _domain_texts(cycle, member, "calibration", limit)


def calibration_rows(cycle: Cycle, member: str) -> int:
    """How many calibration rows the member has (built-in domains: their whole training split)."""
    spec = _released(cycle, member)
    if spec is None:
        return 10**9
    return len(skill_set(SkillSpec(spec.name, spec.data | {"train_limit": None}, spec.target)).train)


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
        raise ValueError(f"atlas.num_vectors: needs {needed} calibration examples, the retained set has only "
                         f"{needed - left} ({available}); lower atlas.num_vectors or raise atlas.per_example")
    return out


def member_data(cycle: Cycle, member: str) -> dict:
    """What the member's texts are a function of (hashed into the atlas content hash)."""
    from evaluation.datafiles import known

    spec = _released(cycle, member)
    if spec is not None:
        s = skill_set(spec)
        return {"skill": spec.name, "dataset": s.dataset_name, "sha256": s.sha256}
    _, _, gate_file, calib_file = BUILTIN[member]
    return {"gate": known(gate_file).sha256, "calibration": known(calib_file).sha256}
