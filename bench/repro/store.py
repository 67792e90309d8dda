"""The committed results of one experiment: one small JSON file per finished unit of work.

    results/repro/<name>/
      experiment.json                      config, its fingerprint, the atlas sha256, machine
      base.json                            the frozen base model on the same subsets
      sweep/<method>/lr-<lr>.json          one learning rate's run (seed seeds[0]): validation losses
      lr/<method>.json                     the rate chosen by validation loss (atlas_core.train.sweep)
      units/<method>/seed<s>-step<N>.json  one scored checkpoint: MBPP+ solved, held-out NLL, retained KL
      runs/<method>-seed<s>.json           a finished run: its checkpoint steps (all must have a unit)

Every file is written atomically (temporary file + rename), so a run killed at any moment
leaves each unit either complete or absent, and a later session continues from there. Files
carry the experiment fingerprint; results of another configuration are refused, not mixed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from atlas_core.io import atomic_write_json

SCHEMA = 1


class StaleResults(RuntimeError):
    """The results folder holds results of a different experiment configuration."""


def lr_tag(lr: float) -> str:
    return f"lr-{lr:g}"


@dataclass
class ResultStore:
    root: Path
    fingerprint: str

    # ------------------------------------------------------------------ paths
    def base_path(self) -> Path:
        return self.root / "base.json"

    def sweep_path(self, method: str, lr: float) -> Path:
        return self.root / "sweep" / method / f"{lr_tag(lr)}.json"

    def lr_path(self, method: str) -> Path:
        return self.root / "lr" / f"{method}.json"

    def unit_path(self, method: str, seed: int, step: int) -> Path:
        return self.root / "units" / method / f"seed{seed}-step{step:06d}.json"

    def run_path(self, method: str, seed: int) -> Path:
        return self.root / "runs" / f"{method}-seed{seed}.json"

    # ------------------------------------------------------------------ reading and writing
    def write(self, path: Path, record: dict) -> None:
        atomic_write_json(path, {"schema": SCHEMA, "fingerprint": self.fingerprint, **record})

    def read(self, path: Path) -> dict | None:
        """The record at `path`, or None if the unit has not been done."""
        if not path.is_file():
            return None
        record = json.loads(path.read_text())
        if record.get("fingerprint") != self.fingerprint:
            raise StaleResults(f"{path}: written by another experiment configuration (fingerprint "
                               f"{str(record.get('fingerprint'))[:12]}, this config {self.fingerprint[:12]}); "
                               "use a new experiment name or delete the folder")
        return record

    def check_experiment(self, config: dict) -> None:
        """Create experiment.json, or check that it describes this configuration."""
        path = self.root / "experiment.json"
        if path.is_file():
            stored = json.loads(path.read_text())
            if stored.get("fingerprint") != self.fingerprint:
                changed = sorted(k for k in set(config) | set(stored.get("config", {}))
                                 if config.get(k) != stored.get("config", {}).get(k))
                raise StaleResults(f"{path}: the stored experiment has another configuration "
                                   f"(fields differing: {changed or 'the method training configs'}); "
                                   "use a new experiment name or delete the folder")
            return
        self.write(path, {"config": config})

    def record_atlas(self, sha256: str, meta: dict) -> None:
        """The atlas the residual methods use; a later session must use the same fit.

        A refit on another CPU (a fresh state dir on a machine with other SIMD kernels) rounds
        the last bits of its floats differently, so its sha256 differs although the fit is the
        same: same plan, the same chart sizes (the same k-means partition) and the same inertia
        to a relative 1e-5. Such a refit is accepted and its sha256 recorded; any other refused.
        """
        path = self.root / "experiment.json"
        stored = self.read(path) or {}
        known = stored.get("atlas_sha256")
        if known is None:
            self._update(path, stored, atlas_sha256=sha256, atlas_meta=meta)
            return
        refits = stored.get("atlas_refits", [])
        if sha256 == known or sha256 in [r["sha256"] for r in refits]:
            return
        old = stored["atlas_meta"]
        differing = sorted(k for k in set(old) | set(meta) if k != "inertia" and old.get(k) != meta.get(k))
        if differing or abs(meta["inertia"] - old["inertia"]) > 1e-5 * abs(old["inertia"]):
            raise StaleResults(f"{path}: results were produced with atlas sha256 {known[:12]}, this session's atlas "
                               f"is {sha256[:12]} and another fit (differing: {differing or ['inertia']}); "
                               "restore the atlas file or start a new experiment name")
        self._update(path, stored, atlas_refits=refits + [{"sha256": sha256, "inertia": meta["inertia"]}])

    def _update(self, path: Path, stored: dict, **fields) -> None:
        """Rewrite the record `stored` (read from `path`) with `fields` added or replaced."""
        self.write(path, {**{k: v for k, v in stored.items() if k not in ("schema", "fingerprint")}, **fields})

    def units(self) -> list[dict]:
        """Every scored checkpoint, in a stable order."""
        return [self.read(p) for p in sorted((self.root / "units").glob("*/*.json"))]

    def sweeps(self) -> list[dict]:
        return [self.read(p) for p in sorted((self.root / "sweep").glob("*/*.json"))]

    def chosen_lr(self, method: str) -> float | None:
        record = self.read(self.lr_path(method))
        return None if record is None else float(record["best_lr"])

    def run_done(self, method: str, seed: int) -> bool:
        """A run is done when it finished training and every one of its checkpoints is scored."""
        record = self.read(self.run_path(method, seed))
        return record is not None and all(self.unit_path(method, seed, s).is_file() for s in record["steps"])
