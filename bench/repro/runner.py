"""The experiment runner: learning-rate sweeps, training runs, and every checkpoint scored.

Order of work (so that an interrupted experiment has its most useful results first):
  1. base      the frozen model on the same subsets (MBPP+, held-out NLL, GSM8K answers)
  2. seed s0 = seeds[0], method by method:
     sweep     per rate in `lr_grid`: train s0 for all epochs, keep the validation losses;
               atlas_core.train.sweep_learning_rate then picks the rate
     run       the s0 run at the chosen rate *is* that rate's sweep run (same config, same
               folder): its checkpoints are scored at once, while the state dir holds them
  3. runs      every other seed, per method, at the chosen rate: train with a checkpoint every
               1/checkpoints_per_epoch epoch; each checkpoint is scored in the trainer's
               `on_checkpoint` callback (MBPP+ solved, held-out NLL, retained KL; GSM8K
               answers at the final one) and written as one unit file.
A session that ends after a few methods leaves those methods complete at seed s0 (a first
matched comparison), and a later session with a fresh state dir never retrains their sweeps.

Resume: weights and optimizer state are in the trainer's checkpoints (state dir); results in
the store (committed). A checkpoint written but not scored when a session ended is scored
first on the next start. If the state dir is gone, a run retrains from scratch (the trainer
is deterministic) and units already stored are not scored again.

Budget: after each unit (one sweep epoch or one scored checkpoint) the runner stops cleanly
when the time used, or the time used plus that unit's duration, exceeds the budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from atlas_core.paths import PROJECT_ROOT, state_dir
from atlas_core.residual import ResidualConfig, build_residual
from atlas_core.train import (
    ResidualAdapter,
    TrainingDiverged,
    WeightLoRA,
    as_adapter,
    build_adapter,
    build_caches,
    epoch_batches,
    list_checkpoints,
    prepare_data,
    read_state,
    sweep_learning_rate,
    train,
)
from atlas_core.train.update_gate import UpdateGate, assistant_header
from evaluation.kl import prompt_token_counts

from .config import ReproConfig
from .scoring import Clock, Memo, Scorer
from .store import ResultStore, lr_tag
from .workload import Workload, default_workload


class BudgetSpent(Exception):
    """The session's time budget is used up; everything finished so far is stored."""


class Budget:
    def __init__(self, minutes: float | None):
        self.limit = None if minutes is None else 60.0 * minutes
        self.started = time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.started

    def after_unit(self, unit_seconds: float) -> None:
        """Stop if the next unit (assumed as long as this one) would not fit."""
        if self.limit is not None and self.used() + unit_seconds > self.limit:
            raise BudgetSpent(
                f"budget of {self.limit / 60:.0f} min: {self.used() / 60:.1f} min used, "
                f"the last unit took {unit_seconds / 60:.1f} min"
            )


def _log(message: str) -> None:
    print(f"[repro {time.strftime('%H:%M:%S')}] {message}", flush=True)


def default_results(config: ReproConfig) -> Path:
    """Where an experiment's results are committed: results/repro/<name>."""
    return PROJECT_ROOT / "results" / "repro" / config.name


def default_runner(config: ReproConfig, results: Path | None = None, budget: Budget | None = None) -> "Runner":
    """The runner of `run` and the bench scripts: the state folder .atlas_state/repro/<name>, the real
    workload, and `results` (default: `default_results`)."""
    state = state_dir() / "repro" / config.name
    return Runner(config, results or default_results(config), state, lambda: default_workload(config, state), budget)


class Runner:
    def __init__(
        self,
        config: ReproConfig,
        results: Path,
        state: Path,
        make_workload: Callable[[], Workload],
        budget: Budget | None = None,
    ):
        self.config, self.state, self.make_workload = config, Path(state), make_workload
        self.store = ResultStore.of(config, results)
        self.budget = budget or Budget(None)
        self.w: Workload | None = None
        self._data = None
        self._scorer: Scorer | None = None
        self._caches = Memo()  # (kind, layer) -> training caches and retained statistics, reused by every run
        self._gate_checked = False  # update_positions answer: the header checked against the data once
        self._unit_started = 0.0
        self._unit_clock = Clock()

    # ------------------------------------------------------------------ plan
    def complete(self, only: Collection[str] | None = None) -> bool:
        """Every unit stored (of the methods named in `only`, when given)."""
        s, methods = self.store, self.config.method_names(only)
        return (
            s.read(s.base_path()) is not None
            and all(s.chosen_lr(m) is not None for m in methods)
            and all(s.run_done(m, seed) for seed in self.config.seeds for m in methods)
        )

    def run(self, only: Collection[str] | None = None) -> bool:
        """Do every missing unit (within the budget), or only those of the methods named in `only`;
        True when every unit (of those methods) is stored."""
        methods = self.config.method_names(only)  # refuses an unknown name before anything is recorded
        self.store.check_experiment(self.config.to_dict())
        if self.complete(only):
            _log("all units are stored: nothing to train or score")
            return True
        self.w = self.make_workload()
        if self.w.atlas is not None:
            self.store.record_atlas(self.w.atlas.sha256, self.w.atlas.meta)
        try:
            self._unit_started = time.monotonic()
            self._unit_clock = Clock()
            if self.store.read(self.store.base_path()) is None:
                self.base()
            for seed in self.config.seeds:
                for method in methods:
                    if self.store.chosen_lr(method) is None:  # only before its first seed
                        self.sweep(method)
                    if not self.store.run_done(method, seed):
                        self.run_one(method, seed, self.store.chosen_lr(method))
        except BudgetSpent as e:
            _log(f"stopping: {e}")  # the stop may come right after the last unit
        return self.complete(only)

    def _between_checkpoints(self, _path: Path, state: dict) -> None:
        """A budget stop may fall between checkpoints, but not between a run's final checkpoint
        and its record: a run stopped there would count as unfinished, and with a fresh state
        dir it would be trained again just to be recorded."""
        if not state["finished"]:
            self._unit_done()

    def _unit_done(self) -> None:
        self._unit_clock = Clock()
        now = time.monotonic()
        seconds, self._unit_started = now - self._unit_started, now
        self.budget.after_unit(seconds)

    # ------------------------------------------------------------------ shared data and caches
    def _train_data(self, train_config):
        if self._data is None:
            self._data = prepare_data(self.w.tokenizer, self.w.train_pairs, train_config, val=self.w.val_pairs)
        return self._data

    @property
    def scorer(self) -> Scorer:
        """Scores a checkpoint (bench/repro/scoring.py); its caches live as long as the workload."""
        if self._scorer is None or self._scorer.w is not self.w:
            heldout_config = self.config.run_config(self.config.reference, 0, 1.0).train
            self._scorer = Scorer(self.w, heldout_config, self.config.eval.kl_batch_size)
        return self._scorer

    def base(self) -> None:
        """The frozen model: a plain residual with B = 0 adds exactly nothing (Delta = B A h = 0)."""
        _log("base model: MBPP+, held-out NLL, GSM8K answers")
        zero = ResidualAdapter(
            build_residual(
                ResidualConfig(variant="plain", layer=self.config.layer, rank=self.config.rank), self.w.model
            )
        )
        record = self.scorer.score(zero, final=True)  # its KL is a check: exactly 0
        self.store.write(self.store.base_path(), {"kind": "base", **self.w.info, **record})
        self._unit_done()

    # ------------------------------------------------------------------ training
    def _run_dir(self, method: str, seed: int, lr: float | None = None) -> Path:
        d = self.state / "runs" / method / f"seed{seed}"
        return d if lr is None else d / lr_tag(lr)

    def _train_config(self, method: str, seed: int, lr: float):
        rc = self.config.run_config(method, seed, lr)
        data = self._train_data(rc.train)
        n_batches = len(epoch_batches(data.train.lengths, rc.train.batch_size, seed, 0, rc.train.bucket_batches))
        steps = math.ceil(n_batches / rc.train.grad_accum)
        every = steps // self.config.checkpoints_per_epoch if self.config.checkpoints_per_epoch > 1 else 0
        return replace(rc, train=replace(rc.train, checkpoint_every_steps=every)), steps

    def _new_adapter(self, rc):
        stats = (
            self._caches.of(("stats", rc.layer), self._retained_stats)
            if rc.adapter == "weight-lora" and rc.lora.needs_stats
            else None
        )
        adapter = as_adapter(build_adapter(rc, self.w.model, self.w.atlas, stats=stats))  # LoRA factors are fp32
        if self.config.update_positions == "answer":  # after the method's own hooks: it gates their result
            self._gate().attach(self.w.model, adapter)
        return adapter

    def _gate(self) -> UpdateGate:
        """A fresh answer-only gate, checked once against the training and KL data: its header must
        end every prompt there (the KL's prompt positions are the positions it masks)."""
        import torch

        gate = UpdateGate(assistant_header(self.w.tokenizer))
        if not self._gate_checked:
            data = self._train_data(self.config.run_config(self.config.reference, 0, 1.0).train)
            for part in (data.train, data.val):
                gate.check(part.ids, part.prompt_len.tolist(), part.name)
            if self.w.kl_prompts is None:
                raise ValueError("workload: update_positions answer needs the KL contexts' prompts (kl_prompts)")
            tok, contexts = self.w.tokenizer, self.w.kl_contexts
            rows = tok(list(contexts), add_special_tokens=False)["input_ids"]
            counts = prompt_token_counts(tok, contexts, self.w.kl_prompts, rows)
            gate.check([torch.tensor(r) for r in rows], counts.tolist(), "kl_contexts")
            self._gate_checked = True
        return gate

    def _retained_stats(self):
        """layer l's o_proj input statistics on the atlas's retained contexts (LoRA-Null, O-LoRA, CorDA-KPM):
        computed once and stored by content (atlas_core.train.retained_stats)."""
        import torch

        from atlas_core.train.retained_stats import retained_stats

        if not self.w.calibration:
            raise ValueError(
                "workload: a method needs retained statistics, but the workload has no calibration contexts"
            )
        ids = [torch.tensor(t) for t in self.w.tokenizer(self.w.calibration, add_special_tokens=False)["input_ids"]]
        return retained_stats(
            self.w.model, self.config.layer, ids, backbone=self.config.backbone, cache_dir=self.state / "retained-stats"
        )

    @contextmanager
    def _adapter(self, rc):
        adapter = self._new_adapter(rc)
        try:
            yield adapter
        finally:
            _release(adapter)

    def _train(self, rc, adapter, run_dir: Path, on_checkpoint):
        data = self._train_data(rc.train)
        caches = self._caches.of(
            ("train", adapter.cache_layer),
            lambda: build_caches(self.w.model, data, adapter.cache_layer, rc.train.cache_batch_size),
        )
        return train(self.w.model, adapter, data, rc.train, run_dir, caches=caches, on_checkpoint=on_checkpoint)

    def sweep(self, method: str) -> None:
        seed = self.config.seeds[0]
        for lr in self.config.lr_grid:
            path = self.store.sweep_path(method, lr)
            if self.store.read(path) is not None:
                continue
            _log(f"sweep {method} lr {lr:g} (seed {seed}, {self.config.epochs} epochs)")
            rc, steps = self._train_config(method, seed, lr)
            with self._adapter(rc) as adapter:
                try:
                    summary = self._train(rc, adapter, self._run_dir(method, seed, lr), self._between_checkpoints)
                    record = {
                        "val_losses": _val_losses(summary.checkpoints),
                        "best_val_loss": summary.best_val_loss,
                        **_own_objective(summary),
                        "diverged": False,
                        "train_seconds": round(summary.seconds, 1),
                    }
                except TrainingDiverged as e:
                    record = {"val_losses": {}, "best_val_loss": None, "diverged": True, "error": str(e)}
            self.store.write(
                path, {"kind": "sweep", "method": method, "seed": seed, "lr": lr, "steps_per_epoch": steps, **record}
            )
            if lr != self.config.lr_grid[-1]:
                self._unit_done()
        # No budget stop between the last sweep run and the choice: the choice reads the runs back
        # from the state dir, and a fresh one would mean training every rate again.
        self.choose_lr(method)
        self._unit_done()

    def choose_lr(self, method: str) -> None:
        """atlas_core.train.sweep_learning_rate over the finished sweep runs (it reads them back
        from their checkpoints rather than training again) picks the rate."""
        seed = self.config.seeds[0]
        rc, _ = self._train_config(method, seed, self.config.lr_grid[0])
        made: list = []

        def fresh():
            if made:
                _release(made[-1])
            made.append(self._new_adapter(rc))
            return made[-1]

        try:
            result = sweep_learning_rate(
                self.w.model,
                fresh,
                self._train_data(rc.train),
                rc.train,
                self.config.lr_grid,
                self._run_dir(method, seed),
                select=self.config.lr_select,
            )
        finally:
            if made:
                _release(made[-1])
        own = "" if result.val_objective is None else f", own objective {result.val_objective}"
        _log(f"{method}: learning rate {result.best_lr:g} (validation loss {result.val_loss}{own})")
        self.store.write(self.store.lr_path(method), {"kind": "lr", "method": method, **result.to_dict()})

    def run_one(self, method: str, seed: int, lr: float) -> None:
        """Train (or resume) one run; score each checkpoint as it is written."""
        _log(f"run {method} seed {seed} lr {lr:g}")
        rc, steps = self._train_config(method, seed, lr)
        run_dir = self._run_dir(method, seed, lr)

        def score(path: Path, state: dict, trained_here: bool = True) -> None:
            step = state["step"]
            if self.store.read(self.store.unit_path(method, seed, step)) is not None:
                return
            self._unit_clock.lap("train")  # training since the previous unit (with validation and checkpoint)
            record = self.scorer.score(adapter, final=state["finished"])
            if trained_here:  # one written before (the sweep's at this rate, an ended session's) cost none now
                record["seconds"]["train"], record["cpu_seconds"]["train"] = (
                    self._unit_clock.wall["train"],
                    self._unit_clock.cpu["train"],
                )
            self.store.write(
                self.store.unit_path(method, seed, step),
                {
                    "kind": "checkpoint",
                    "method": method,
                    "seed": seed,
                    "lr": lr,
                    "step": step,
                    "epoch": step / steps,
                    "final": state["finished"],
                    "val_loss": state["val_losses"].get(str(step)),
                    "train_seconds": round(state["seconds"], 1),
                    **record,
                },
            )
            _log(
                f"  {method} seed {seed} step {step}: solved {record['mbpp_plus']['solved']}, "
                f"NLL {record['heldout_nll']:.4f}, KL {record['kl']['mean']:.4g}"
            )
            self._between_checkpoints(path, state)

        with self._adapter(rc) as adapter:
            # written but not scored: by the sweep (seed 0 at the chosen rate), or when an earlier session ended
            for path in list_checkpoints(run_dir):
                state = read_state(path)
                if self.store.read(self.store.unit_path(method, seed, state["step"])) is None:
                    adapter.load_weights(path / "adapter.safetensors")
                    score(path, state, trained_here=False)
            summary = self._train(rc, adapter, run_dir, score)
        self.store.write(
            self.store.run_path(method, seed),
            {
                "kind": "run",
                "method": method,
                "seed": seed,
                "lr": lr,
                "steps_per_epoch": steps,
                "steps": [int(Path(c).name.split("-")[1]) for c in summary.checkpoints],
                "train_seconds": round(summary.seconds, 1),
                "tokens": summary.tokens,
            },
        )
        self._unit_done()


def _val_losses(checkpoints: list[str]) -> dict:
    return read_state(checkpoints[-1])["val_losses"] if checkpoints else {}


def _own_objective(summary) -> dict:
    """STM's and TALR's validation losses under their own objective, next to the CE ones."""
    if summary.best_val_objective is None:
        return {}
    state = read_state(summary.checkpoints[-1])
    return {"val_objective": state["val_objective"], "best_val_objective": summary.best_val_objective}


def _release(adapter) -> None:
    """Leave the model as the frozen backbone: the update gate's hooks off, a LoRA taken out."""
    if getattr(adapter, "update_gate", None) is not None:
        adapter.update_gate.detach()
    if isinstance(adapter, WeightLoRA):
        adapter.remove()
