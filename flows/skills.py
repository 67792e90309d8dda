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

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from atlas_core.errors import InputError

from .config import SKILL_SOURCES, SkillData, UpdateConfig, resolve

BUILTIN_SOURCES = SKILL_SOURCES


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
        """A stored spec, its data fields completed with today's defaults (a spec stored before a
        field existed compares equal to the same spec written now)."""
        return cls(d["name"], asdict(SkillData()) | dict(d["data"]), dict(d["target"]))  # a record: not re-validated

    def to_dict(self) -> dict:
        return {"name": self.name, "data": self.data, "target": self.target}

    @property
    def skill_data(self) -> SkillData:
        return SkillData(**self.data)


def resolve_snapshot(source: str | Path, where: str = "data.source") -> Path:
    """A skill file, or the newest complete snapshot of a folder of them.

    A folder's snapshots are its `*.jsonl` files, newest = last by name (name them so they sort
    by time, e.g. 2026-12-03.jsonl; modification times change when files are copied). Only
    complete files are visible: names starting with '.' are files still being written (write
    `.name.jsonl`, then rename); and a folder that has `<name>.jsonl.sha256` sidecars takes only
    snapshots whose sidecar exists and matches (a writer adds the sidecar last)."""
    path = resolve(source)
    if path.is_dir():
        snapshots = sorted(p for p in path.glob("*.jsonl") if not p.name.startswith(".") and p.is_file())
        if any(_sidecar(p).is_file() for p in snapshots):
            snapshots = [p for p in snapshots if _sidecar(p).is_file()]
        if not snapshots:
            raise InputError(f"{where}: folder {path} holds no complete *.jsonl snapshot")
        path = snapshots[-1]
    elif not path.is_file():
        raise InputError(f"{where}: expected 'mbpp', 'gsm8k', a JSONL skill file or a folder of them, got {source!r}")
    _check_sidecar(path, where)
    return path


def _sidecar(snapshot: Path) -> Path:
    return snapshot.with_name(snapshot.name + ".sha256")


def _check_sidecar(snapshot: Path, where: str) -> None:
    """A snapshot with a sha256 sidecar (`sha256sum` format or the bare hash) must match it."""
    from atlas_core.io import sha256_file

    sidecar = _sidecar(snapshot)
    if not sidecar.is_file():
        return
    expected = (sidecar.read_text().split() or [""])[0].lower()
    if sha256_file(snapshot) != expected:
        raise InputError(
            f"{where}: {snapshot} does not match its sidecar {sidecar.name} (sha256 {expected[:16]}...): "
            "still being written, or changed after it was taken"
        )


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
        name, sha = (
            ("mbpp-sanitized", known("mbpp/sanitized-mbpp.json").sha256)
            if data.source == "mbpp"
            else ("gsm8k-train", known("gsm8k/train.jsonl").sha256)
        )
    else:
        from atlas_core.io import sha256_file

        train = _jsonl_pairs(data.source)
        if data.val_source:
            val = _jsonl_pairs(data.val_source)
        else:
            train, val = holdout_split(train, data.holdout)
        name, sha = Path(data.source).stem, sha256_file(resolve(data.source))
    split = "train" if data.val_source or data.source in BUILTIN_SOURCES else f"train[holdout {data.holdout:g}]"
    split += f"[:{data.train_limit}]" if data.train_limit else ""
    return SkillSet(first(train, data.train_limit), first(val, data.val_limit), name, split, sha)


def holdout_split(pairs: list[dict], share: float) -> tuple[list[dict], list[dict]]:
    """(training pairs, held-out pairs) of one snapshot, in file order.

    A pair is held out when the sha256 of its prompt, read as a number in [0, 1), is below
    `share`: the split depends on the pair alone, so a pair stays on its side in every later
    snapshot of the skill (a refreshed snapshot never trains on what an earlier release held
    out). With share > 0 and two or more pairs, at least one pair lands on each side."""
    if share <= 0 or len(pairs) < 2:
        return pairs, []
    rank = [int(hashlib.sha256(p["prompt"].encode()).hexdigest()[:15], 16) / 16**15 for p in pairs]
    held = {i for i, r in enumerate(rank) if r < share}
    if not held:
        held = {min(range(len(pairs)), key=rank.__getitem__)}
    if len(held) == len(pairs):
        held.discard(max(range(len(pairs)), key=rank.__getitem__))
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


def require_evaluable(spec: SkillSpec, role: str) -> None:
    """Refuse, before anything trains, a skill whose data a cycle could not use: the skill taught
    now (`role` 'target') and every released skill ('released': its held-out pairs are retained
    KL contexts, its training pairs calibrate the atlas) need both sides, and their files readable."""
    what = "the skill taught now" if role == "target" else "a released skill of the line"
    try:
        s = skill_set(SkillSpec(spec.name, spec.data | {"train_limit": None, "val_limit": None}, spec.target))
    except (InputError, OSError) as e:  # e.g. a released skill's snapshot file removed since
        raise InputError(f"skill {spec.name!r} ({what}): {e}") from e
    if not s.train:
        raise InputError(f"skill {spec.name!r} ({what}): no training pairs in {spec.data['source']}")
    if not s.val:
        fix = (
            "give data.val_source (a JSONL file of held-out pairs) or data.holdout > 0"
            if spec.data["source"] not in BUILTIN_SOURCES
            else "its built-in split is empty"
        )
        raise InputError(
            f"skill {spec.name!r} ({what}): no held-out pairs in {spec.data['source']} for its evaluation "
            f"and retained contexts; {fix}"
        )


def skill_contexts(tokenizer, spec: SkillSpec, role: str, limit: int) -> tuple[list[str], list[str]]:
    """(prompts, teacher-forced texts) of a released skill as the trainer renders them: its held-out
    pairs for gating ('gate') and its training pairs for the atlas ('calibration'); disjoint sets."""
    from evaluation.contexts import rendered_pairs

    s = skill_set(SkillSpec(spec.name, spec.data | {"train_limit": None, "val_limit": None}, spec.target))
    rows = s.val if role == "gate" else s.train
    if not rows:
        raise InputError(
            f"released skill {spec.name!r}: no {'held-out' if role == 'gate' else 'training'} pairs "
            "for its retained contexts (a JSONL skill needs data.val_source)"
        )
    return rendered_pairs(tokenizer, [(p["prompt"], p["response"]) for p in rows[:limit]])


def skill_files(spec: SkillSpec) -> dict[str, Path]:
    """The user files a skill reads, by data field: its JSONL snapshot and held-out file."""
    return {
        k: resolve(spec.data[k])
        for k in ("source", "val_source")
        if spec.data.get(k) and spec.data[k] not in BUILTIN_SOURCES
    }


def pinned_spec(spec: dict, kept: dict[str, str] | None, fetch: Callable[[str, Path], Path], cache: Path) -> dict:
    """A released skill's stored spec, reading exactly the files its release trained on.

    Training keeps each file of the skill in the artifact store by sha256 (`kept`: data field ->
    sha256); a file removed or rewritten since (old snapshots pruned, a snapshot overwritten in
    place) is read from a verified copy under `cache` instead, so a data refresh never changes or
    breaks what later cycles keep of a released skill. The copy keeps the file's name (its
    dataset name is the name's stem)."""
    from atlas_core.io import sha256_file

    data = dict(spec["data"])
    for key, sha in (kept or {}).items():
        path = resolve(data[key])
        if path.is_file() and sha256_file(path) == sha:
            continue
        copy = cache / sha[:16] / path.name
        if not copy.is_file():
            fetch(sha, copy)
        data[key] = str(copy)
    return spec | {"data": data}


def released_skills(chain_specs: list[dict], training: str) -> list[SkillSpec]:
    """The skills a champion's chain taught (oldest first; a retrained skill keeps its newest spec),
    without the one being trained now."""
    latest: dict[str, SkillSpec] = {}
    for d in chain_specs:
        spec = SkillSpec.from_dict(d)
        latest.pop(spec.name, None)
        latest[spec.name] = spec
    return [s for name, s in latest.items() if name != training]
