"""Skills of a line: what one release teaches, and what later releases must keep of it.

A skill is a name, a training set (a data snapshot), a target scorer and its evaluation set
(spec CONTINUAL.md). Its spec is stored with every training run, so a later cycle can rebuild
a released skill exactly as the release that taught it measured it: the skill's scorer
becomes a no-regression check and its held-out pairs become retained KL contexts.

The retained set R of a cycle for skill S is the configured retained domains plus every
released skill other than S. Each member gives two disjoint sets of texts: gating rows
(retained KL) and calibration rows (the atlas); a released skill gates on its held-out
(validation) pairs and calibrates on its training pairs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from .config import SkillData, TargetSpec, UpdateConfig, resolve

BUILTIN_SOURCES = ("mbpp", "gsm8k")


@dataclass(frozen=True)
class SkillSpec:
    """What a release teaches, as plain JSON-able values (stored on its training runs)."""

    name: str
    data: dict  # flows.config.SkillData fields, `source` resolved to one snapshot file
    target: dict  # flows.config.TargetSpec fields

    @classmethod
    def from_config(cls, config: UpdateConfig) -> "SkillSpec":
        data = asdict(config.data)
        if data["source"] not in BUILTIN_SOURCES:
            data["source"] = str(resolve_snapshot(data["source"]))
        return cls(config.skill, data, asdict(config.target))

    @classmethod
    def from_dict(cls, d: dict) -> "SkillSpec":
        return cls(d["name"], dict(d["data"]), dict(d["target"]))

    def to_dict(self) -> dict:
        return {"name": self.name, "data": self.data, "target": self.target}

    @property
    def skill_data(self) -> SkillData:
        return SkillData(**self.data)

    @property
    def target_spec(self) -> TargetSpec:
        return TargetSpec(**self.target)


def resolve_snapshot(source: str | Path) -> Path:
    """A skill file, or the newest snapshot (*.jsonl, by modification time, then name) of a folder."""
    path = resolve(source)
    if path.is_dir():
        snapshots = sorted(path.glob("*.jsonl"), key=lambda p: (p.stat().st_mtime, p.name))
        if not snapshots:
            raise ValueError(f"data.source: folder {path} holds no *.jsonl snapshot")
        return snapshots[-1]
    if not path.is_file():
        raise ValueError(f"data.source: expected 'mbpp', 'gsm8k', a JSONL skill file or a folder of them, got {source!r}")
    return path


# ------------------------------------------------------------------------------ pairs
@dataclass(frozen=True)
class SkillSet:
    """Training pairs of the skill plus what identifies them in the ledger."""

    train: list[dict]
    val: list[dict]
    dataset_name: str
    split: str
    sha256: str


def _jsonl_pairs(path: str) -> list[dict]:
    from evaluation.userdata import load_skill_jsonl

    return [{"prompt": e.prompt, "response": e.response, "id": e.id} for e in load_skill_jsonl(resolve(path))]


def first(rows: list, limit: Optional[int]) -> list:
    return rows if limit is None else rows[:limit]


def skill_set(spec: SkillSpec) -> SkillSet:
    data = spec.skill_data
    if data.source in BUILTIN_SOURCES:
        from evaluation import data as builtin
        from evaluation.datafiles import known

        pairs = builtin.mbpp_pairs if data.source == "mbpp" else builtin.gsm8k_pairs
        train, val = pairs("train"), pairs("validation" if data.source == "mbpp" else "test")
        name, sha = (("mbpp-sanitized", known("mbpp/sanitized-mbpp.json").sha256) if data.source == "mbpp"
                     else ("gsm8k-train", known("gsm8k/train.jsonl").sha256))
    else:
        from registry import sha256_file

        train = _jsonl_pairs(data.source)
        val = _jsonl_pairs(data.val_source) if data.val_source else []
        name, sha = Path(data.source).stem, sha256_file(resolve(data.source))
    split = f"train[:{data.train_limit}]" if data.train_limit else "train"
    return SkillSet(first(train, data.train_limit), first(val, data.val_limit), name, split, sha)


def skill_texts(tokenizer, spec: SkillSpec, role: str, limit: int) -> list[str]:
    """Teacher-forced texts of a released skill as the trainer renders them: its held-out pairs
    for gating ('gate') and its training pairs for the atlas ('calibration'); disjoint sets."""
    from atlas_core.train import render_chat

    s = skill_set(SkillSpec(spec.name, spec.data | {"train_limit": None, "val_limit": None}, spec.target))
    rows = s.val if role == "gate" else s.train
    if not rows:
        raise ValueError(f"released skill {spec.name!r}: no {'held-out' if role == 'gate' else 'training'} pairs "
                         "for its retained contexts (a JSONL skill needs data.val_source)")
    return ["".join(render_chat(tokenizer, p["prompt"], p["response"])) for p in rows[:limit]]


def released_skills(chain_specs: list[dict], training: str) -> list[SkillSpec]:
    """The skills a champion's chain taught (oldest first; a retrained skill keeps its newest spec),
    without the one being trained now."""
    latest: dict[str, SkillSpec] = {}
    for d in chain_specs:
        spec = SkillSpec.from_dict(d)
        latest.pop(spec.name, None)
        latest[spec.name] = spec
    return [s for name, s in latest.items() if name != training]
