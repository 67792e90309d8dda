"""The main job end to end: `atlas update` on a fresh state folder (cold: GGUF conversion,
atlas fit, training, evaluation of base and candidates), then again on the same state
(warm: everything reused, the candidates gated against the first champion).

    .venv/bin/python bench/update_cycle.py [--config configs/update/default.yaml]
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
from bench.common import machine  # noqa: E402


def run_update(state: Path, config: str) -> tuple[float, str]:
    env = {**os.environ, "ATLAS_STATE_DIR": str(state), "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "atlas"), "update", "--config", config], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"atlas update failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    outcome = next((line.strip() for line in proc.stdout.splitlines() if "promoted" in line.lower()), "")
    return seconds, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/update/default.yaml")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="atlas-bench-state-") as tmp:
        cold, first = run_update(Path(tmp), args.config)
        warm, second = run_update(Path(tmp), args.config)
    print(f"machine: {machine()}")
    print(f"atlas update --config {args.config}, fresh state folder, then again on the same state")
    print(f"  first cycle (cold):  {cold / 60:6.1f} min   {first[:110]}")
    print(f"  second cycle (warm): {warm / 60:6.1f} min   {second[:110]}")
    print(f"  reuse speed-up {cold / warm:.1f}x; target for the first cycle: < 20 min")


if __name__ == "__main__":
    main()
