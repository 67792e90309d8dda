"""What a training run reports when it ends (atlas_core.train.train returns it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class TrainSummary:
    run_dir: str
    steps: int
    epochs: int
    tokens: int  # real (non-padding) target-set tokens processed
    seconds: float  # training time, summed over resumed segments
    final_train_loss: float | None
    final_val_loss: float | None
    best_val_loss: float | None
    best_checkpoint: str | None
    checkpoints: list[str]
    prefix_cache_layer: int | None
    issues: list[dict] = field(default_factory=list)  # examples skipped or truncated
    resumed_from: str | None = None
    teacher_cached: bool | None = None  # set by the Output-KL objective
    budget: dict | None = None  # method, rank, budget_rank, trainable, budget (the adapter's `budget()`)
    stm: dict | None = None  # set by the STM objective: its mask's key, tau, dropped, tokens, path
    notes: list[str] = field(default_factory=list)  # lines an objective adds to `format()`
    best_val_objective: float | None = None  # least validation loss under the run's own objective (STM, TALR)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        val = lambda v: "n/a" if v is None else f"{v:.4f}"
        lines = [
            f"training summary ({self.run_dir})",
            f"  steps {self.steps}, epochs {self.epochs}, tokens {self.tokens:,}, time {self.seconds:.1f} s "
            f"({self.tokens_per_s:,.0f} tokens/s)",
            f"  final train loss {val(self.final_train_loss)}, final val loss {val(self.final_val_loss)}, "
            f"best val loss {val(self.best_val_loss)}"
            + ("" if self.best_val_objective is None else f" (own objective {val(self.best_val_objective)})"),
            "  prefix cache: "
            + (f"layer {self.prefix_cache_layer}" if self.prefix_cache_layer is not None else "off")
            + (f", resumed from {self.resumed_from}" if self.resumed_from else ""),
            f"  best checkpoint: {self.best_checkpoint}",
            f"  checkpoints ({len(self.checkpoints)}): " + ", ".join(Path(c).name for c in self.checkpoints),
        ]
        if self.budget:
            b = self.budget
            lines.append(
                f"  adapter {b['method']}: rank {b['rank']} (budget rank {b['budget_rank']}), "
                f"trainable {b['trainable']:,} (budget r (d_in + d_out) = {b['budget']:,})"
            )
        lines += [f"  {note}" for note in self.notes]
        lines += [f"  {x['action']}: #{x['index']} ({x['id']}): {x['reason']}" for x in self.issues]
        return "\n".join(lines)


def summarize(run_dir, state: dict, data, layer, resumed_from) -> TrainSummary:
    """The summary of a run from its final state (`data`: the TrainData it trained on)."""
    vals = {int(k): v for k, v in state["val_losses"].items()}
    best_step = min(vals, key=vals.get) if vals else None
    best = next((c for c in state["checkpoints"] if c.endswith(f"step-{best_step:06d}")), None) if vals else None
    issues = [asdict(x) | {"set": s.name} for s in data.sets().values() for x in s.issues]
    return TrainSummary(
        run_dir=str(run_dir),
        steps=state["step"],
        epochs=state["epoch"],
        tokens=state["tokens"],
        seconds=state["seconds"],
        final_train_loss=state["train_losses"][-1] if state["train_losses"] else None,
        final_val_loss=vals[max(vals)] if vals else None,
        best_val_loss=vals[best_step] if vals else None,
        best_checkpoint=best,
        checkpoints=list(state["checkpoints"]),
        prefix_cache_layer=layer,
        issues=issues,
        resumed_from=resumed_from,
        best_val_objective=min(state.get("val_objective", {}).values(), default=None),
    )
