"""Learning-rate sweep: train one fresh adapter per rate, keep the rate with the lowest
validation loss (spec section 4: "chosen by validation loss").

`select` says which validation loss: "ce" (token cross-entropy, every method alike) or
"objective" (the run's own objective where its target term is not CE: STM's kept tokens, TALR's
weighted sum; CE for every other objective). Both choices are recorded whichever selects.

The prefix caches are built once and shared by every rate (same model, same layer), so a
sweep costs the upper-layer training passes only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from torch import nn

from ..io import atomic_write_json
from .adapters import as_adapter
from .config import TrainConfig
from .trainer import TrainData, TrainingDiverged, TrainSummary, build_caches, train

SELECT = ("ce", "objective")


@dataclass
class SweepResult:
    best_lr: float  # the rate `select` chose
    val_loss: dict[float, float]  # rate -> best CE validation loss over its checkpoints
    summaries: dict[float, TrainSummary]
    select: str = "ce"
    val_objective: dict[float, float] | None = None  # rate -> best own-objective validation loss; None: it is CE

    def chosen(self) -> dict[str, float]:
        """The rate each criterion picks (SELECT)."""
        own = self.val_objective if self.val_objective is not None else self.val_loss
        return {"ce": min(self.val_loss, key=self.val_loss.get), "objective": min(own, key=own.get)}

    def to_dict(self) -> dict:
        losses = lambda d: {repr(k): (v if v != float("inf") else "diverged") for k, v in d.items()}
        out = {
            "best_lr": self.best_lr,
            "val_loss": losses(self.val_loss),
            "best_checkpoints": {repr(k): s.best_checkpoint for k, s in self.summaries.items()},
        }
        if self.val_objective is not None:  # only then can the two criteria differ
            out |= {"select": self.select, "val_objective": losses(self.val_objective), "chosen": self.chosen()}
        return out


def sweep_learning_rate(
    model: nn.Module,
    make_adapter: Callable[[], object],
    data: TrainData,
    config: TrainConfig,
    rates: Sequence[float],
    run_dir: str | Path,
    select: str = "ce",
) -> SweepResult:
    """Train `make_adapter()` (a fresh adapter each call, same seed) at each rate in `rates` under
    `run_dir/lr-<rate>/`; pick the rate whose best validation loss is lowest. Resumable: a rate
    whose run already finished is read back from its checkpoints. `select`: SELECT (module docstring).

    For Weight-LoRA, `make_adapter` must remove the previous rate's LoRA from the model first
    (WeightLoRA.remove) or build on a fresh model.
    """
    if data.val is None:
        raise ValueError("data.val: a learning-rate sweep needs validation examples")
    if select not in SELECT:
        raise ValueError(f"select: expected one of {list(SELECT)}, got {select!r}")
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates: expected positive learning rates, got {list(rates)}")
    run_dir = Path(run_dir)
    caches = None
    val_loss, val_objective, summaries = {}, {}, {}
    for lr in rates:
        adapter = as_adapter(make_adapter())
        if caches is None and config.prefix_cache:
            caches = build_caches(model, data, adapter.cache_layer, config.cache_batch_size)
        try:
            summary = train(
                model,
                adapter,
                data,
                replace(config, lr=float(lr)),
                run_dir / f"lr-{lr:g}",
                caches=caches if config.prefix_cache else None,
            )
        except TrainingDiverged:  # a rate too high for this run: it loses, the sweep goes on
            val_loss[float(lr)] = val_objective[float(lr)] = float("inf")
            continue
        val_loss[float(lr)], summaries[float(lr)] = summary.best_val_loss, summary
        val_objective[float(lr)] = summary.best_val_objective
    if not summaries:
        raise TrainingDiverged(f"rates: every rate in {list(rates)} diverged")
    missing = sorted(lr for lr, v in val_objective.items() if v is None)
    if select == "objective" and missing and len(missing) < len(summaries):
        raise ValueError(
            f"{run_dir}: rates {missing} have no own-objective validation loss (trained before it was recorded); "
            "remove their run folders to train them again"
        )
    result = SweepResult(0.0, val_loss, summaries, select, None if missing else val_objective)
    result.best_lr = result.chosen()[select]
    atomic_write_json(run_dir / "sweep.json", result.to_dict())
    return result
