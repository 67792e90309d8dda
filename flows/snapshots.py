"""`atlas snapshot add`: a skill's new training data, written completely, announced as a Prefect event.

    add_snapshot(file, line, skill, state)  -> Snapshot   validated, copied into the line's snapshot folder
    announce(snapshot)                      -> bool       event `atlas.snapshot.added` (when a server is set)

A line's snapshots of a skill live in `<state>/snapshots/<line>/<skill>/`, named by the UTC time they
were added (`20261204T151200Z.jsonl`, so the newest sorts last) with a `sha256sum` sidecar: the file is
written under a hidden name and renamed, then the sidecar is written the same way, so a cycle never
takes a half-written snapshot (flows/skills.py: resolve_snapshot). Point a config's `data.source` at
the folder and every cycle trains on its newest snapshot.

The event lets a deployment start a cycle as soon as data arrives, next to its cron schedule
(deploy/prefect.yaml: a trigger matching `atlas.snapshot.<line>.<skill>` passes the snapshot's path
as the `update` flow's `snapshot` parameter; flows/events.py). Without PREFECT_API_URL no event is sent
(there is no server to hear it; the next scheduled cycle takes the snapshot).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from atlas_core.errors import InputError


@dataclass(frozen=True)
class Snapshot:
    line: str
    skill: str
    path: str  # the written snapshot
    sha256: str
    pairs: int

    @property
    def resource_id(self) -> str:
        """What a deployment trigger matches: one resource per line and skill."""
        return f"atlas.snapshot.{self.line}.{self.skill}"


def snapshot_folder(state: Path, line: str, skill: str) -> Path:
    return state / "snapshots" / line / skill


def add_snapshot(file: str | Path, line: str, skill: str, state: Path) -> Snapshot:
    """Validate `file` (JSONL pairs `{"id", "prompt", "response"}`) and copy it, complete, into the
    line's snapshot folder of `skill`; the same content added twice is one snapshot."""
    from atlas_core.io import sha256_file
    from evaluation.userdata import load_skill_jsonl

    from .config import NAME

    for name, value in (("--line", line), ("--skill", skill)):
        if not NAME.match(value):
            raise InputError(f"{name}: expected a name of letters, digits, '_', '.', '-', got {value!r}")
    source = Path(file)
    if not source.is_file():
        raise InputError(f"{file}: no such file (expected a JSONL file of prompt/response pairs)")
    pairs = len(load_skill_jsonl(source))  # bad input (no rows, a missing field): one line naming file, row, field
    sha = sha256_file(source)
    folder = snapshot_folder(state, line, skill)
    folder.mkdir(parents=True, exist_ok=True)
    for known in sorted(folder.glob("*.jsonl.sha256")):
        if known.read_text().split()[0] == sha:  # already added: nothing new to train on
            return Snapshot(line, skill, str(known.with_suffix("")), sha, pairs)
    target = folder / f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S%fZ}.jsonl"
    _write_atomically(target, source.read_bytes())
    _write_atomically(target.with_name(target.name + ".sha256"), f"{sha}  {target.name}\n".encode())
    return Snapshot(line, skill, str(target), sha, pairs)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write under a hidden name in the same folder, flush to disk, rename: complete or absent."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def announce(snapshot: Snapshot) -> bool:
    """Emit `atlas.snapshot.added` (flows/events.py); False when no Prefect server is configured."""
    from .events import SNAPSHOT_ADDED, emit

    labels = {
        "prefect.resource.name": Path(snapshot.path).name,
        "atlas.line": snapshot.line,
        "atlas.skill": snapshot.skill,
    }
    return emit(
        SNAPSHOT_ADDED,
        snapshot.resource_id,
        labels,
        {"path": snapshot.path, "sha256": snapshot.sha256, "pairs": snapshot.pairs},
    )
