"""Learning-rate sweep: train one fresh adapter per rate, keep the rate with the lowest
validation loss (spec section 4: "chosen by validation loss").

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


@dataclass
class SweepResult:
    best_lr: float
    val_loss: dict[float, float]  # rate -> best validation loss over its checkpoints
    summaries: dict[float, TrainSummary]

    def to_dict(self) -> dict:
        return {
            "best_lr": self.best_lr,
            "val_loss": {repr(k): (v if v != float("inf") else "diverged") for k, v in self.val_loss.items()},
            "best_checkpoints": {repr(k): s.best_checkpoint for k, s in self.summaries.items()},
        }


def sweep_learning_rate(
    model: nn.Module,
    make_adapter: Callable[[], object],
    data: TrainData,
    config: TrainConfig,
    rates: Sequence[float],
    run_dir: str | Path,
) -> SweepResult:
    """Train `make_adapter()` (a fresh adapter each call, same seed) at each rate in `rates` under
    `run_dir/lr-<rate>/`; pick the rate whose best validation loss is lowest. Resumable: a rate
    whose run already finished is read back from its checkpoints.

    For Weight-LoRA, `make_adapter` must remove the previous rate's LoRA from the model first
    (WeightLoRA.remove) or build on a fresh model.
    """
    if data.val is None:
        raise ValueError("data.val: a learning-rate sweep needs validation examples")
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates: expected positive learning rates, got {list(rates)}")
    run_dir = Path(run_dir)
    caches = None
    val_loss, summaries = {}, {}
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
            val_loss[float(lr)] = float("inf")
            continue
        val_loss[float(lr)], summaries[float(lr)] = summary.best_val_loss, summary
    if not summaries:
        raise TrainingDiverged(f"rates: every rate in {list(rates)} diverged")
    best = min(val_loss, key=val_loss.get)
    result = SweepResult(best, val_loss, summaries)
    atomic_write_json(run_dir / "sweep.json", result.to_dict())
    return result
