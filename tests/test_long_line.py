"""The long-line benchmark's smoke run (bench/long_line.py on the tiny model, eight releases on one
line): every release promotes, and a cycle's stage time and the champion's load time stay flat as the line
grows (at most +10% per release already on the line), because champion-side work is reused by
content; each release adds one delta's bytes to the release folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_eight_tiny_releases_keep_cycle_and_load_time_flat(tmp_path):
    out = tmp_path / "long-line.json"
    env = os.environ | {"PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)  # its own embedded state and Prefect, as a user's run has
    done = subprocess.run(
        [sys.executable, "bench/long_line.py", "--backbone", "tiny-llama", "--releases", "8", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows, summary = result["rows"], result["summary"]
    assert [r["t"] for r in rows] == list(range(1, 9))
    # The cycle's stages: on a 6 s tiny cycle the wall time moves by whole seconds (Prefect's end of a
    # flow run, the candidate's subflow included), noise larger than the goal (CI measured +11.7% on a
    # flat line, +1.0% +- 3.1% here), so a slope fails only when it is above +10% by more than twice its
    # standard error. Measured with work injected per delta already on the line (a sleep in the lineage
    # stage): 2 s per delta gives +18.0% +- 0.9% and fails; 1 s per delta (+15.0% +- 2.0%) is at the edge.
    # The default backbone's wall time is in docs/BENCHMARKS.md.
    stages = [round(sum(r["phases"].values()), 2) for r in rows]
    stage_bound = summary["stage_growth"] - 2 * summary["stage_growth_se"]
    assert stage_bound <= 0.10, (summary, stages, [round(r["cycle_s"], 2) for r in rows])
    load_bound = summary["load_growth"] - 2 * summary["load_growth_se"]
    assert load_bound <= 0.10, (summary, [round(r["load_s"], 3) for r in rows])
    sizes = [r["bytes"] for r in rows]
    assert all(b > a for a, b in zip(sizes, sizes[1:]))  # one more delta per release
    assert all("line_OP" in r["history"] for r in rows) and "line_BWT" in rows[-1]["history"]
    assert "growth per release" in done.stdout
