"""Run every benchmark script and rewrite its section of docs/BENCHMARKS.md.

    .venv/bin/python bench/run_all.py            # all of them (about 15-25 min on 2 cores)
    .venv/bin/python bench/run_all.py atlas_fit decoding   # just these

Each script measures its ratio against its own baseline in the same run and prints the
result; this runner puts that output, the command and the date between the markers
<!-- bench:NAME --> and <!-- /bench:NAME --> of docs/BENCHMARKS.md. Text outside the
markers (the reading of the numbers) is left as it is. Run it on an otherwise idle
machine: with 2 cores, any other process halves what a benchmark measures.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "BENCHMARKS.md"
# name -> (script arguments, what it measures); the order is the order of the doc.
BENCHMARKS = {
    "dtype": (["bench/dtype.py"], "bf16 vs fp32 on this machine (what dtype auto picks)"),
    "atlas_fit": (["bench/atlas_fit.py"], "Atlas fit vs scikit-learn KMeans + per-chart PCA"),
    "extraction": (["bench/extraction.py"], "Extraction stopping at layer l vs a full forward"),
    "residual_operator": (["bench/residual_operator.py"], "Residual operator cost vs a d x 4d matmul"),
    "train_prefix_cache": (["bench/train_prefix_cache.py"], "Training with vs without the frozen-prefix cache"),
    "kl_cache": (["bench/kl_cache.py"], "Retained KL with caches vs two full forwards"),
    "decoding": (["bench/decoding.py"], "Decoding throughput, base vs adapted"),
    "update_cycle": (["bench/update_cycle.py"], "End-to-end update cycle (the main job)"),
    "long_line": (["bench/long_line.py"], "A long line: eight releases on one line, each release's cost"),
}


def run(name: str) -> str:
    args, _ = BENCHMARKS[name]
    if not (ROOT / args[0]).is_file():
        return f"(not run: {args[0]} does not exist yet)"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}  # as the platform runs
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env)
    # Keep the report lines; drop progress bars and library chatter that went to stderr.
    out = proc.stdout.strip()
    if proc.returncode != 0:
        out += f"\n(exit code {proc.returncode})\n" + "\n".join(proc.stderr.strip().splitlines()[-15:])
    return out


def section(name: str, output: str) -> str:
    args, title = BENCHMARKS[name]
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (
        f"<!-- bench:{name} -->\n### {title}\n\n`.venv/bin/python {' '.join(args)}` ({stamp})\n\n"
        f"```\n{output}\n```\n<!-- /bench:{name} -->"
    )


def rewrite(doc: str, name: str, block: str) -> str:
    pattern = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench:{name} -->", re.S)
    return pattern.sub(lambda _: block, doc) if pattern.search(doc) else doc.rstrip() + "\n\n" + block + "\n"


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"== {name}", flush=True)
        output = run(name)
        print(output, flush=True)
        doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
        tmp = DOC.with_suffix(".md.tmp")
        tmp.write_text(rewrite(doc, name, section(name, output)))
        tmp.replace(DOC)  # a crash mid-run leaves the doc as it was after the last benchmark
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
