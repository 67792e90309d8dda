"""The committed results of one experiment: one small JSON file per finished unit of work.

    results/repro/<name>/
      experiment.json                      config, its and every method's fingerprint, the atlas sha256
      base.json                            the frozen base model on the same subsets
      sweep/<method>/lr-<lr>.json          one learning rate's run (seed seeds[0]): validation losses
      lr/<method>.json                     the rate chosen by validation loss (atlas_core.train.sweep)
      units/<method>/seed<s>-step<N>.json  one scored checkpoint: MBPP+ solved, held-out NLL, retained KL
      runs/<method>-seed<s>.json           a finished run: its checkpoint steps (all must have a unit)

Every file is written atomically (temporary file + rename), so a run killed at any moment
leaves each unit either complete or absent, and a later session continues from there.

Fingerprints (bench.repro.config): base.json and experiment.json carry the experiment's, of the
settings shared by every method; a method's sweep, lr, units and runs files carry the method's
(its training config combined with the experiment's). experiment.json records the config and
every method's fingerprint, so the report checks the files without the config files. Results of
another configuration are refused, not mixed: a changed shared setting refuses the experiment, a
changed training config refuses that method's files only; adding a method or a seed refuses nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from atlas_core.io import atomic_write_json

from .config import SHARED

SCHEMA = 1


class StaleResults(RuntimeError):
    """The results folder holds results of a different experiment configuration."""


def lr_tag(lr: float) -> str:
    return f"lr-{lr:g}"


def _differing(new: dict, old: dict, prefix: str = "") -> list[str]:
    """The fields (dotted into sections) whose values differ."""
    out = []
    for k in sorted(set(new) | set(old)):
        a, b = new.get(k), old.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differing(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(prefix + k)
    return out


def _rerun(method: str) -> str:
    return (
        f"delete the method's files (sweep/{method}/, lr/{method}.json, units/{method}/, "
        f"runs/{method}-seed*.json) to rerun it"
    )


@dataclass
class ResultStore:
    root: Path
    fingerprint: str  # the experiment's: base.json, experiment.json
    methods: dict[str, str] = field(default_factory=dict)  # method name -> its fingerprint

    @classmethod
    def of(cls, config, root: Path) -> "ResultStore":
        """The store of a ReproConfig's results folder."""
        return cls(Path(root), config.fingerprint(), config.method_fingerprints())

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

    def method_of(self, path: Path) -> str | None:
        """The method whose file `path` is (None: an experiment-wide file)."""
        parts = Path(path).relative_to(self.root).parts
        if parts[0] in ("sweep", "units") and len(parts) == 3:
            return parts[1]
        if parts[0] == "lr" and len(parts) == 2:
            return Path(parts[1]).stem
        if parts[0] == "runs" and len(parts) == 2 and "-seed" in parts[1]:
            return parts[1].rsplit("-seed", 1)[0]
        return None

    def method_files(self, method: str) -> list[Path]:
        paths = [
            *(self.root / "sweep" / method).glob("*.json"),
            self.lr_path(method),
            *(self.root / "units" / method).glob("*.json"),
            *(self.root / "runs").glob(f"{method}-seed*.json"),
        ]
        return sorted(p for p in paths if p.is_file() and self.method_of(p) == method)

    def expected(self, path: Path) -> str:
        """The fingerprint the file at `path` must carry."""
        method = self.method_of(path)
        if method is None:
            return self.fingerprint
        if method not in self.methods:
            raise StaleResults(
                f"{path}: method {method!r} is not one of this experiment's methods "
                f"{sorted(self.methods)} (no fingerprint recorded for it)"
            )
        return self.methods[method]

    # ------------------------------------------------------------------ reading and writing
    def write(self, path: Path, record: dict) -> None:
        atomic_write_json(path, {"schema": SCHEMA, "fingerprint": self.expected(path), **record})

    def read(self, path: Path) -> dict | None:
        """The record at `path`, or None if the unit has not been done."""
        if not path.is_file():
            return None
        record = json.loads(path.read_text())
        expected, found = self.expected(path), str(record.get("fingerprint"))
        if found != expected:
            method = self.method_of(path)
            what = (
                "another experiment configuration; use a new experiment name or delete the folder"
                if method is None
                else f"another training config of method {method!r}; restore that config, or {_rerun(method)}"
            )
            raise StaleResults(f"{path}: written by {what} (fingerprint {found[:12]}, this config {expected[:12]})")
        return record

    def check_experiment(self, config: dict) -> None:
        """Create experiment.json, or check that it describes this configuration: the same shared
        settings and first seed (the sweeps' seed), and each method that has files the same training
        config. Methods and seeds added are recorded (the stored config and method fingerprints)."""
        path = self.root / "experiment.json"
        if not path.is_file():
            self.write(path, {"config": config, "method_fingerprints": self.methods})
            return
        stored = json.loads(path.read_text())
        old = stored.get("config", {})
        if stored.get("fingerprint") != self.fingerprint:
            changed = _differing({k: config.get(k) for k in SHARED}, {k: old.get(k) for k in SHARED})
            if changed:
                why = f"fields differing: {', '.join(changed)}"
            elif "method_fingerprints" not in stored:
                why = f"its files carry old whole-config fingerprints: run python -m bench.repro.migrate {self.root}"
            else:
                why = "no shared field differs, but the fingerprint does"
            raise StaleResults(
                f"{path}: the stored experiment has another configuration ({why}); "
                "use a new experiment name or delete the folder"
            )
        if old.get("seeds") and config["seeds"][0] != old["seeds"][0]:
            raise StaleResults(
                f"{path}: seeds: the stored sweeps were run at seed {old['seeds'][0]}, this config's "
                f"first seed is {config['seeds'][0]}; keep it first and add seeds after it"
            )
        recorded = stored.get("method_fingerprints", {})
        for method, fp in self.methods.items():
            files = self.method_files(method) if recorded.get(method, fp) != fp else []
            if files:
                source = next((m["config"] for m in config["methods"] if m["name"] == method), "?")
                raise StaleResults(
                    f"{files[0]}: method {method!r}: its training config ({source}) is not the one "
                    f"its {len(files)} stored files were produced with; restore it, or "
                    f"{_rerun(method)}; the other methods' results stay valid"
                )
        merged = {**recorded, **self.methods}  # a method left out of the config keeps its files checkable
        if old != config or merged != recorded:
            self._update(path, stored, config=config, method_fingerprints=merged)

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
            raise StaleResults(
                f"{path}: results were produced with atlas sha256 {known[:12]}, this session's atlas "
                f"is {sha256[:12]} and another fit (differing: {differing or ['inertia']}); "
                "restore the atlas file or start a new experiment name"
            )
        self._update(path, stored, atlas_refits=refits + [{"sha256": sha256, "inertia": meta["inertia"]}])

    def _update(self, path: Path, stored: dict, **fields) -> None:
        """Rewrite the record `stored` (read from `path`) with `fields` added or replaced."""
        self.write(path, {**{k: v for k, v in stored.items() if k not in ("schema", "fingerprint")}, **fields})

    def units(self, methods: list[str]) -> list[dict]:
        """Every scored checkpoint of these methods, in a stable order."""
        return [self.read(p) for p in sorted(p for m in methods for p in (self.root / "units" / m).glob("*.json"))]

    def sweeps(self, methods: list[str]) -> list[dict]:
        return [self.read(p) for p in sorted(p for m in methods for p in (self.root / "sweep" / m).glob("*.json"))]

    def chosen_lr(self, method: str) -> float | None:
        record = self.read(self.lr_path(method))
        return None if record is None else float(record["best_lr"])

    def run_done(self, method: str, seed: int) -> bool:
        """A run is done when it finished training and every one of its checkpoints is scored."""
        record = self.read(self.run_path(method, seed))
        return record is not None and all(self.unit_path(method, seed, s).is_file() for s in record["steps"])
