"""Run (or continue) an experiment, then write its report from the stored results.

    .venv/bin/python -m bench.repro.run --config configs/repro/smollm2.yaml --budget-minutes 140 \
        --docs docs/RESULTS.md

`--methods a b` trains and scores only those methods' missing units (say, one method's new seeds).
Re-running a finished experiment trains and scores nothing: it reads results/repro/<name>/
and rewrites the same tables. Exit status 0 when the experiment is complete, 3 when the
budget stopped it (run the same command again to continue).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from atlas_core.typed_config import ConfigError

from .config import load_repro_config
from .report import update_docs, write_report
from .runner import Budget, default_results, default_runner
from .store import ResultStore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.repro.run", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="experiment file (configs/repro/*.yaml)")
    parser.add_argument(
        "--budget-minutes",
        type=float,
        default=None,
        help="stop cleanly after the unit that would make the next one overrun this budget",
    )
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from stored results")
    parser.add_argument("--docs", type=Path, default=None, help="also replace this experiment's section of this file")
    parser.add_argument("--results", type=Path, default=None, help="results folder (default results/repro/<name>)")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="train and score only these methods of the experiment (default: all); the others' stored units stay",
    )
    args = parser.parse_args(argv)

    config = load_repro_config(args.config)
    results = args.results or default_results(config)
    complete = True
    if not args.report_only:
        started = time.perf_counter()
        runner = default_runner(config, results, Budget(args.budget_minutes))
        try:
            complete = runner.run(args.methods)
        except ConfigError as e:
            parser.error(str(e))
        print(
            f"[repro] session: {(time.perf_counter() - started) / 60:.1f} min; experiment "
            f"{'complete' if complete else 'not complete yet (run the same command again)'}"
            f"{' for ' + ', '.join(args.methods) if args.methods else ''}",
            flush=True,
        )
    if (results / "experiment.json").is_file():
        if args.report_only:  # refuse a changed config; record methods and seeds added to it
            ResultStore.of(config, results).check_experiment(config.to_dict())
        text = write_report(results)
        if args.docs:
            update_docs(args.docs, config.name, text)
        print(text)
    return 0 if complete else 3


if __name__ == "__main__":
    sys.exit(main())
