"""The main job end to end: the continual demo's two releases (`atlas update` with v1's and v2's
config and policy, as scripts/main.sh runs them) on a fresh state folder (cold: GGUF conversion,
two atlas fits, training, evaluation), then the same two cycles again on the same state, which
must be idle (both snapshots are already in the champion's chain).

    .venv/bin/python bench/update_cycle.py [--state EMPTY_FOLDER]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import machine, reading  # noqa: E402

RELEASES = (
    ("v1 code", "configs/update/default.yaml", "configs/policy/default.yaml"),
    ("v2 GSM8K format", "configs/update/gsm8k-format.yaml", "configs/policy/gsm8k-format.yaml"),
)


def run_update(state: Path, config: str, policy: str) -> tuple[float, str]:
    env = {**os.environ, "ATLAS_STATE_DIR": str(state), "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "atlas"), "update", "--config", config, "--policy", policy],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"atlas update failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    outcome = next(
        (line.strip() for line in proc.stdout.splitlines() if "promoted" in line.lower() or ": idle:" in line), ""
    )
    return seconds, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--state", default=None, help="an empty folder to keep the line's state in (bench/eval_candidate.py reads it)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="atlas-bench-state-") as tmp:
        state = Path(args.state or tmp)
        if state.exists() and any(state.iterdir()):
            raise SystemExit(f"--state {state}: expected an empty or new folder (the main job runs from nothing)")
        cold = [(name, *run_update(state, c, p)) for name, c, p in RELEASES]
        warm = [(name, *run_update(state, c, p)) for name, c, p in RELEASES]
    print(f"machine: {machine()}")
    print("the main job's two releases on a fresh state folder, then both again on the same state")
    for label, runs in (("cold", cold), ("again", warm)):
        for name, seconds, outcome in runs:
            print(f"  {name:16s} {label:5s} {seconds / 60:5.1f} min   {outcome[:120]}")
    total_cold, total_warm = sum(s for _, s, _ in cold), sum(s for _, s, _ in warm)
    print(
        f"  both releases: {total_cold / 60:.1f} min (target < 20 min); again (idle): {total_warm / 60:.1f} min, "
        f"{total_cold / total_warm:.0f}x less"
    )
    reading(
        "the main job: the continual demo's two releases from an empty state",
        f"{total_cold / 60:.1f} min ("
        + ", ".join(f"{n} {s / 60:.1f}" for n, s, _ in cold)
        + f"); rerun idle {total_warm / 60:.1f} min",
        "< 20 min",
        "yes" if total_cold < 20 * 60 else "**no**",
    )


if __name__ == "__main__":
    main()
