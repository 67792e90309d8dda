"""Run every benchmark script and rewrite its section of docs/BENCHMARKS.md, then the Reading table.

    .venv/bin/python bench/run_all.py            # all of them (about 80-100 min on 2 cores)
    .venv/bin/python bench/run_all.py atlas_fit decoding   # just these

Each script measures its ratio against its own baseline in the same run and prints the result;
this runner puts that output between the markers <!-- bench:NAME --> and <!-- /bench:NAME --> of
docs/BENCHMARKS.md under a line naming the command, the date, the commit and the machine. The
lines a script prints as `reading: {json}` (bench.common.reading) become the rows of the Reading
table (between <!-- reading --> and <!-- /reading -->), rebuilt from every section in the doc after
each benchmark, each row with its own section's date, commit and machine: no figure in the doc
is typed by hand. Run it on an otherwise idle machine: with 2 cores, any other process halves
what a benchmark measures.

`update_cycle` keeps the main job's state in .bench-state/main-job, which `eval_candidate`
measures (its candidates are the main job's releases): run both, in that order.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "BENCHMARKS.md"
MAIN_JOB_STATE = ROOT / ".bench-state" / "main-job"
# name -> (script arguments, what it measures); the order is the order of the doc.
BENCHMARKS = {
    "dtype": (["bench/dtype.py"], "bf16 vs fp32 on this machine (what dtype auto picks)"),
    "atlas_fit": (["bench/atlas_fit.py"], "Atlas fit vs scikit-learn KMeans + per-chart PCA"),
    "extraction": (["bench/extraction.py"], "Extraction stopping at layer l vs a full forward"),
    "residual_operator": (["bench/residual_operator.py"], "Residual operator cost vs a d x 4d matmul"),
    "train_prefix_cache": (
        ["bench/train_prefix_cache.py", "--curve", "15,20,24"],
        "Training with vs without the frozen-prefix cache",
    ),
    "kl_cache": (["bench/kl_cache.py"], "Retained KL with caches vs two full forwards"),
    "kl_memory": (["bench/kl_memory.py"], "Peak memory of one checkpoint's retained KL"),
    "decoding": (["bench/decoding.py"], "Decoding throughput, base vs adapted"),
    "status": (["bench/status.py"], "`atlas status` without a Prefect server"),
    "update_cycle": (
        ["bench/update_cycle.py", "--state", str(MAIN_JOB_STATE)],
        "End-to-end update cycle (the main job)",
    ),
    "eval_candidate": (["bench/eval_candidate.py"], "One candidate's whole evaluation, previous vs current"),
    "fan_out": (["bench/fan_out.py"], "Candidates fanned out over a work pool: one worker vs two"),
    "long_line": (["bench/long_line.py"], "A long line: eight releases on one line, each release's cost"),
}
STAMP = re.compile(r"^`[^`]*` \((?P<date>[\d-]+ [\d:]+)(?:; commit (?P<commit>[^;]+); (?P<machine>.*))?\)$", re.M)


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # The doc itself changes as sections are written: only other tracked changes make the code differ from HEAD.
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", f":!{DOC.relative_to(ROOT)}")
    return head + ("+changes" if changed else "")


def run(name: str) -> str:
    args, _ = BENCHMARKS[name]
    if not (ROOT / args[0]).is_file():
        return f"(not run: {args[0]} does not exist yet)"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}  # as the platform runs
    if name == "update_cycle":
        shutil.rmtree(MAIN_JOB_STATE, ignore_errors=True)  # the main job starts from nothing
    if name == "eval_candidate":
        env["ATLAS_STATE_DIR"] = str(MAIN_JOB_STATE)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env)
    # Keep the report lines; drop progress bars and library chatter that went to stderr.
    out = proc.stdout.strip()
    if proc.returncode != 0:
        out += f"\n(exit code {proc.returncode})\n" + "\n".join(proc.stderr.strip().splitlines()[-15:])
    return out


def section(name: str, output: str, machine: str) -> str:
    args, title = BENCHMARKS[name]
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (
        f"<!-- bench:{name} -->\n### {title}\n\n`.venv/bin/python {' '.join(args)}` "
        f"({stamp}; commit {commit()}; {machine})\n\n```\n{output}\n```\n<!-- /bench:{name} -->"
    )


def rewrite(doc: str, name: str, block: str) -> str:
    pattern = re.compile(rf"<!-- {name} -->.*?<!-- /{name} -->", re.S)
    return pattern.sub(lambda _: block, doc) if pattern.search(doc) else doc.rstrip() + "\n\n" + block + "\n"


def reading_table(doc: str) -> str:
    """The Reading table from the `reading:` lines of every section in the doc, in BENCHMARKS order."""
    rows = [
        "| benchmark | measured | target | met | run (date; commit; machine) |",
        "|---|---|---|---|---|",
    ]
    for name in BENCHMARKS:
        found = re.search(rf"<!-- bench:{name} -->(.*?)<!-- /bench:{name} -->", doc, re.S)
        if found is None:
            rows.append(f"| {name} | (not run yet: `bash bench/run_all {name}`) | | | |")
            continue
        stamp = STAMP.search(found.group(1))
        run_of = "not recorded"
        if stamp:
            run_of = (
                f"{stamp['date']}; {stamp['commit'] or 'commit not recorded'}; {stamp['machine'] or 'see its section'}"
            )
        readings = [
            json.loads(line.removeprefix("reading: "))
            for line in found.group(1).splitlines()
            if line.startswith("reading: ")
        ]
        if not readings:
            rows.append(f"| {name} | (no reading line in its section: `bash bench/run_all {name}`) | | | {run_of} |")
        for r in readings:
            rows.append(f"| {r['benchmark']} | {r['measured']} | {r['target']} | {r['met']} | {run_of} |")
    return "<!-- reading -->\n" + "\n".join(rows) + "\n<!-- /reading -->"


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from bench.common import machine

    where = machine()
    for name in names:
        print(f"== {name}", flush=True)
        output = run(name)
        print(output, flush=True)
        doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
        doc = rewrite(doc, f"bench:{name}", section(name, output, where))
        doc = rewrite(doc, "reading", reading_table(doc))
        tmp = DOC.with_suffix(".md.tmp")
        tmp.write_text(doc)
        tmp.replace(DOC)  # a crash mid-run leaves the doc as it was after the last benchmark
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
