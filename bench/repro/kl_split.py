"""Add the prompt/answer split of retained KL to checkpoints scored before it existed (issue 32).

    .venv/bin/python -m bench.repro.kl_split --config configs/repro/smollm2.yaml \
        --methods atlas centered plain weight-lora --seeds 0

Units scored before evaluation.kl split KL by position kind hold it as one mean; their runs' weights
are not kept. The trainer is deterministic, so a run retrained at its stored rate reaches the same
checkpoints: each is scored for retained KL only (no MBPP+, no held-out NLL) and the result stored
next to the original measurement as the unit's `kl_split` (the full record: mean, by kind, per
context), with the replay's own validation loss. The stored `kl` is never changed; the agreement of
the two means (and of the two validation losses) says whether the replay is the run that was scored:
a replay whose validation loss differs from the stored one by more than `--tolerance` (relative) is
refused rather than stored.

Resumable like the runner: units that have `kl_split` are skipped, replay checkpoints written but not
scored are scored first (state folder <state>/repro/<name>/replay/).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from atlas_core.paths import state_dir
from atlas_core.train import list_checkpoints, read_state
from atlas_core.typed_config import ConfigError

from .config import load_repro_config
from .runner import Runner, _log, default_results
from .workload import default_workload


class ReplayMismatch(RuntimeError):
    """The retrained run is not the run whose checkpoints were scored."""


class KLReplay(Runner):
    """A runner that retrains finished runs and adds the split KL to their stored units."""

    tolerance = 1e-3

    def pending(self, method: str, seed: int) -> list[dict]:
        """The run's stored units without `kl_split` (a run not finished has none to add to)."""
        run = self.store.read(self.store.run_path(method, seed))
        if run is None:
            raise ValueError(f"{self.store.run_path(method, seed)}: no finished run of {method} seed {seed} to replay")
        units = [self.store.read(self.store.unit_path(method, seed, step)) for step in run["steps"]]
        return [u for u in units if "kl_split" not in u]

    def replay(self, method: str, seed: int) -> int:
        """Retrain one run and add `kl_split` to each of its units; returns how many were added."""
        pending = {u["step"]: u for u in self.pending(method, seed)}
        if not pending:
            return 0
        if self.w is None:
            self.w = self.make_workload()
            if self.w.atlas is not None:  # the residual methods' atlas must be the one they were trained with
                self.store.record_atlas(self.w.atlas.sha256, self.w.atlas.meta)
        lr = self.store.chosen_lr(method)
        _log(f"replay {method} seed {seed} lr {lr:g}: {len(pending)} checkpoints to split")
        rc, _ = self._train_config(method, seed, lr)
        run_dir = self.state / "replay" / method / f"seed{seed}"
        added = 0

        def score(_path: Path, state: dict) -> None:
            nonlocal added
            unit = pending.pop(state["step"], None)
            if unit is None:
                return
            val = state["val_losses"].get(str(state["step"]))
            stored_val = unit.get("val_loss")
            if stored_val is not None and abs(val - stored_val) > self.tolerance * abs(stored_val):
                raise ReplayMismatch(
                    f"{self.store.unit_path(method, seed, state['step'])}: replay validation loss {val:.6f}, "
                    f"stored {stored_val:.6f} (relative tolerance {self.tolerance:g}): not the scored run"
                )
            split = self.scorer.retained_kl(adapter).to_record()
            if split["positions"] != unit["kl"]["positions"]:
                raise ReplayMismatch(
                    f"{self.store.unit_path(method, seed, state['step'])}: KL over {split['positions']} positions, "
                    f"the stored over {unit['kl']['positions']}: not the same contexts"
                )
            record = {k: v for k, v in unit.items() if k not in ("schema", "fingerprint")}
            self.store.write(
                self.store.unit_path(method, seed, state["step"]),
                {**record, "kl_split": {**split, "replay_val_loss": val}},
            )
            added += 1
            kinds = split.get("by_kind", {})
            _log(
                f"  {method} seed {seed} step {state['step']}: KL {split['mean']:.4g} "
                f"(stored {unit['kl']['mean']:.4g}); "
                + ", ".join(f"{k} {v['mean']:.4g}" for k, v in kinds.items() if v["mean"] is not None)
            )

        with self._adapter(rc) as adapter:
            for path in list_checkpoints(run_dir):
                state = read_state(path)
                if state["step"] in pending:
                    adapter.load_weights(path / "adapter.safetensors")
                    score(path, state)
            if pending:
                self._train(rc, adapter, run_dir, score)
        if pending:
            raise ReplayMismatch(f"{method} seed {seed}: the replay wrote no checkpoint at steps {sorted(pending)}")
        return added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.repro.kl_split", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="experiment file (configs/repro/*.yaml)")
    parser.add_argument("--methods", nargs="+", required=True, help="methods whose finished runs to replay")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--results", type=Path, default=None, help="results folder (default results/repro/<name>)")
    parser.add_argument("--tolerance", type=float, default=KLReplay.tolerance, help="relative, on validation loss")
    args = parser.parse_args(argv)

    config = load_repro_config(args.config)
    try:
        config.method_names(args.methods)
    except ConfigError as e:
        parser.error(f"{args.config}: {e}")
    state = state_dir() / "repro" / config.name
    replay = KLReplay(config, args.results or default_results(config), state, lambda: default_workload(config, state))
    replay.tolerance = args.tolerance
    replay.store.check_experiment(config.to_dict())
    for method in args.methods:
        for seed in args.seeds:
            _log(f"{method} seed {seed}: {replay.replay(method, seed)} units given the split KL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
