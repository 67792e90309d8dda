"""A skill's data snapshots: which file of a folder is taken (complete or invisible), its held-out
split, and the check that refuses a skill a cycle could not use, all before anything trains."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import pytest

from atlas_core.errors import InputError
from flows.config import SkillData, TargetSpec
from flows.skills import SkillSpec, holdout_split, require_evaluable, resolve_snapshot, skill_set


def pairs(n: int, start: int = 0) -> list[dict]:
    return [
        {"id": f"p{i}", "prompt": f"Write function number {i}.", "response": f"def f{i}(): return {i}"}
        for i in range(start, start + n)
    ]


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_newest_snapshot_is_the_last_by_name_not_by_modification_time(tmp_path):
    write(tmp_path / "2026-12-02.jsonl", pairs(3))
    write(tmp_path / "2026-12-01.jsonl", pairs(3))  # written last: the newest mtime
    assert resolve_snapshot(tmp_path).name == "2026-12-02.jsonl"


def test_a_snapshot_still_being_written_is_invisible(tmp_path):
    write(tmp_path / "2026-12-01.jsonl", pairs(3))
    write(tmp_path / ".2026-12-02.jsonl", pairs(2))  # a writer's temporary name, renamed when complete
    assert resolve_snapshot(tmp_path).name == "2026-12-01.jsonl"
    (tmp_path / ".2026-12-02.jsonl").rename(tmp_path / "2026-12-02.jsonl")
    assert resolve_snapshot(tmp_path).name == "2026-12-02.jsonl"


def test_in_a_folder_with_sidecars_only_a_snapshot_with_a_matching_sidecar_is_taken(tmp_path):
    first = write(tmp_path / "2026-12-01.jsonl", pairs(3))
    (tmp_path / "2026-12-01.jsonl.sha256").write_text(
        hashlib.sha256(open(first, "rb").read()).hexdigest() + "  2026-12-01.jsonl\n"
    )
    write(tmp_path / "2026-12-02.jsonl", pairs(2))  # its sidecar is not written yet
    assert resolve_snapshot(tmp_path).name == "2026-12-01.jsonl"
    (tmp_path / "2026-12-02.jsonl.sha256").write_text("0" * 64 + "\n")  # does not match
    with pytest.raises(InputError, match=r"--snapshot: .*2026-12-02.jsonl does not match its sidecar"):
        resolve_snapshot(tmp_path, "--snapshot")


def test_a_folder_without_a_complete_snapshot_is_refused_by_name(tmp_path):
    write(tmp_path / ".partial.jsonl", pairs(2))
    with pytest.raises(InputError, match="data.source: folder .* holds no complete"):
        resolve_snapshot(tmp_path)


def test_the_held_out_split_is_by_prompt_and_stable_across_snapshots():
    first = pairs(200)
    train, held = holdout_split(first, 0.1)
    assert 10 <= len(held) <= 30 and len(train) + len(held) == 200
    assert {p["id"] for p in train}.isdisjoint(p["id"] for p in held)
    # A later snapshot (rows added, order changed): every pair keeps its side.
    later_train, later_held = holdout_split(list(reversed(pairs(250))), 0.1)
    assert {p["id"] for p in held} <= {p["id"] for p in later_held}
    assert {p["id"] for p in train} <= {p["id"] for p in later_train}
    # Two pairs and a share too small to hold either out: still one on each side.
    assert [len(side) for side in holdout_split(pairs(2), 0.001)] == [1, 1]
    assert holdout_split(pairs(5), 0.0) == (pairs(5), [])


def spec(tmp_path, source: str, **data) -> SkillSpec:
    return SkillSpec("s", asdict(SkillData(source=source, val_limit=None)) | data, asdict(TargetSpec()))


def test_a_jsonl_skill_without_val_source_is_evaluated_on_its_held_out_split(tmp_path):
    s = skill_set(spec(tmp_path, write(tmp_path / "s.jsonl", pairs(40))))
    assert s.val and s.train and len(s.val) + len(s.train) == 40 and s.split == "train[holdout 0.1]"
    require_evaluable(spec(tmp_path, str(tmp_path / "s.jsonl")), "target")


def test_a_skill_a_cycle_could_not_use_is_refused_before_training_with_the_fix(tmp_path):
    one = write(tmp_path / "one.jsonl", pairs(1))  # one pair: nothing can be held out
    with pytest.raises(InputError, match=r"skill 's' \(the skill taught now\): no held-out pairs .*data.val_source"):
        require_evaluable(spec(tmp_path, one), "target")
    gone = spec(tmp_path, write(tmp_path / "gone.jsonl", pairs(9)))
    (tmp_path / "gone.jsonl").unlink()  # a released skill's snapshot removed since
    with pytest.raises(InputError, match=r"skill 's' \(a released skill of the line\): .*gone.jsonl"):
        require_evaluable(gone, "released")


def test_a_stored_spec_is_a_record_completed_with_todays_defaults(tmp_path):
    stored = {
        "name": "s",
        "data": {"source": str(tmp_path / "removed.jsonl"), "val_source": None, "train_limit": None, "val_limit": 16},
        "target": asdict(TargetSpec()),
    }
    restored = SkillSpec.from_dict(stored)  # a file removed since is not an error here (not re-validated)
    assert restored.data["holdout"] == SkillData().holdout
