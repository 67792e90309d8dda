"""`atlas status`'s Prefect query in local mode (no PREFECT_API_URL): read in-process from the local
database (current) versus through Prefect's client, which first starts a temporary server
(previous), each in a fresh process, as a command-line call would be, on a temporary state folder
whose Prefect database holds runs of a flow named 'update'.

    .venv/bin/python bench/status.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import machine, reading  # noqa: E402

SETUP = """
from flows.platform import configure_environment; configure_environment()
from prefect import flow
@flow(name="update")
def update(): return 1
for _ in range(3): update()
"""
QUERY = """
from flows.platform import configure_environment; configure_environment()
from flows import prefect_runs
scheduled, recent = prefect_runs.{reader}(5)
print(len(recent))
"""
READERS = {
    "current (local database, in-process)": "_update_runs_local",
    "previous (Prefect client + temporary server)": "_update_runs_from_server",
}


def run(code: str, env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as state:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env |= {
            "ATLAS_STATE_DIR": state,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "OMP_WAIT_POLICY": "PASSIVE",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        }  # the previous path timed out under load
        run(SETUP, env)  # three 'update' runs in the local database
        times = {name: [] for name in READERS}
        runs = {}
        for _ in range(args.repeat):  # interleaved
            for name, reader in READERS.items():
                seconds, runs[name] = run(QUERY.format(reader=reader), env)
                times[name].append(seconds)
    print(f"machine: {machine()}")
    print(f"`atlas status`'s Prefect query in a fresh process, local mode, median of {args.repeat} (interleaved):")
    for name in READERS:
        print(f"  {name:45s} {statistics.median(times[name]):5.1f} s  ({runs[name]} runs read)")
    current, previous = (statistics.median(times[n]) for n in READERS)
    print(f"  ratio previous / current: {previous / current:.1f}x")
    reading(
        "`atlas status` in local mode, fresh process",
        f"{current:.1f} s, previous (client + temporary server) {previous:.1f} s: {previous / current:.1f}x",
        "no temporary server",
        "yes" if current < previous else "**no**",
    )


if __name__ == "__main__":
    main()
