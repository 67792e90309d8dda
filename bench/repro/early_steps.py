"""A method's first epoch at a finer grain: held-out NLL and retained KL every few steps.

The matched comparison reads a method's KL at an NLL level from its checkpoints (the least KL
of a checkpoint at or below that level). A method whose first checkpoint (one epoch) already
lands below a level is charged that checkpoint's KL there, although a shorter run would have
reached the level with less movement. This retrains the seed-0 run at the chosen rate (the
trainer is deterministic, so the end of the epoch reproduces the stored unit, which is checked)
with a checkpoint every `--every` steps, and scores each on the held-out NLL and the retained
KL exactly as the runner does (no MBPP+, no answers). Nothing is written to the results.

    .venv/bin/python -m bench.repro.early_steps --config configs/repro/smollm2.yaml --method atlas --every 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline, like the runner
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

from .config import load_repro_config
from .runner import Runner, default_runner


def early_steps(runner: Runner, method: str, every: int) -> tuple[list[tuple[int, float, float]], dict | None]:
    """(step, held-out NLL, retained KL) every `every` steps of the first epoch of `method`'s seed-0
    run at its chosen rate, and the stored unit of that epoch's end (None if not stored)."""
    if every < 1:
        raise ValueError(f"every: expected a number of steps >= 1, got {every}")
    lr = runner.store.chosen_lr(method)
    if lr is None:
        raise ValueError(f"method {method!r}: no learning rate chosen yet (run the experiment first)")
    seed = runner.config.seeds[0]
    runner.w = runner.w or runner.make_workload()
    rc, steps = runner._train_config(method, seed, lr)
    rc = replace(rc, train=replace(rc.train, epochs=1, checkpoint_every_steps=every))
    rows: list[tuple[int, float, float]] = []

    with runner._adapter(rc) as adapter:

        def score(_path: Path, state: dict) -> None:
            nll, moved = runner.scorer.heldout_nll(adapter), runner.scorer.retained_kl(adapter)
            rows.append((state["step"], nll, moved.mean))
            print(f"  step {state['step']:3d}  NLL {nll:.4f}  KL {moved.mean:.3e}", flush=True)

        runner.state.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=runner.state) as run_dir:
            runner._train(rc, adapter, Path(run_dir), score)
    return rows, runner.store.read(runner.store.unit_path(method, seed, steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    args = parser.parse_args()
    config = load_repro_config(args.config)
    runner = default_runner(config)
    print(f"{args.method} seed {config.seeds[0]}: step, held-out NLL, retained KL over the first epoch")
    rows, stored = early_steps(runner, args.method, args.every)
    if stored is not None:  # the deterministic retrain reproduces the stored unit
        print(f"  stored unit at step {stored['step']}: NLL {stored['heldout_nll']:.4f}  KL {stored['kl']['mean']:.3e}")


if __name__ == "__main__":
    main()
