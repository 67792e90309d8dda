"""The training loop shared by every residual variant, every weight adapter (Weight-LoRA and the
published baselines) and the objective baselines.

    data = prepare_data(tokenizer, train_pairs, val_pairs, retained_texts, config)
    summary = train(model, residual_or_lora, data, config, run_dir)

One optimizer step = `grad_accum` micro-batches. With the prefix cache (default) the
frozen layers below the adapter ran once per data set and each step runs only the
layers above. The run checkpoints at every epoch end (and every `checkpoint_every_steps`
steps) and resumes from its newest complete checkpoint: data order is a pure function of
(seed, epoch) and the optimizer state is restored, so a resumed run ends with the same
weights as an uninterrupted one.

Every step asks the run's objective (atlas_core.train.objectives, registered by kind with
atlas_core.methods: ce, replay, output-kl, stm, talr or a plugin's) for one loss per micro-batch,
and backpropagates each; the objective adds the trained delta's regulariser (`adapter.penalty()`:
O-LoRA, CLoRA) once per step. The summary prints every method's rank and trainable count next
to the spec's budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import methods
from ..io import atomic_write_json, config_hash
from .adapters import as_adapter
from .checkpoint import (
    checkpoint_dir,
    clean_temporary,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    write_checkpoint,
)
from .config import TrainConfig
from .data import TokenizedSet, as_examples, collate, epoch_batches, render_chat, tokenize
from .objectives import Run, mean_loss
from .prefix_cache import PrefixCache
from .summary import TrainSummary, summarize

__all__ = ["TrainData", "TrainSummary", "TrainingDiverged", "build_caches", "lr_at", "prepare_data", "train"]


class TrainingDiverged(RuntimeError):
    """A loss or gradient became NaN/inf; the last good checkpoint is kept."""


@dataclass
class TrainData:
    train: TokenizedSet
    pad_id: int
    val: TokenizedSet | None = None
    retained: TokenizedSet | None = None

    def sets(self) -> dict[str, TokenizedSet]:
        return {
            k: v for k, v in (("train", self.train), ("val", self.val), ("retained", self.retained)) if v is not None
        }


def prepare_data(
    tokenizer,
    train: Sequence,
    config: TrainConfig,
    val: Sequence | None = None,
    retained: Sequence | None = None,
    chat: bool = True,
) -> TrainData:
    """Tokenise (prompt, response) records; with `chat`, pairs are rendered with the tokenizer's
    chat template first (`render_chat`). Retained records may be bare strings (all supervised)."""

    def prep(records, name):
        examples = as_examples(records, name)
        if chat:
            examples = [
                e if not e.prompt else type(e)(*render_chat(tokenizer, e.prompt, e.response), e.id) for e in examples
            ]
        return tokenize(tokenizer, examples, config.max_length, config.on_bad_example, name)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TrainData(
        prep(train, "train"),
        int(pad_id),
        prep(val, "val") if val else None,
        prep(retained, "retained") if retained else None,
    )


def build_caches(model: nn.Module, data: TrainData, layer: int | None, batch_size: int = 16) -> dict[str, PrefixCache]:
    """Prefix caches of every set in `data` at `layer` (empty if `layer` is None). Reusable across
    runs that share the model and the layer (e.g. a learning-rate sweep)."""
    if layer is None:
        return {}
    return {name: PrefixCache.build(model, s, layer, data.pad_id, batch_size) for name, s in data.sets().items()}


def lr_at(step: int, total: int, config: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): a pure function, so resume needs no state."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    if config.schedule == "cosine":
        return config.lr * 0.5 * (1 + math.cos(math.pi * progress))
    return config.lr * (1 - progress)


def _freeze_backbone(model: nn.Module, trainable: list[nn.Parameter]) -> None:
    """Everything but the adapter's factors is frozen, and eval mode turns dropout off (the
    prefix cache and exact resume both need a deterministic backbone)."""
    ours = {id(p) for p in trainable}
    for p in model.parameters():
        if id(p) not in ours:
            p.requires_grad_(False)
    for p in trainable:
        p.requires_grad_(True)
    model.eval()


def train(
    model: nn.Module,
    adapter,
    data: TrainData,
    config: TrainConfig,
    run_dir: str | Path,
    *,
    caches: dict[str, PrefixCache] | None = None,
    resume: bool = True,
    on_checkpoint: Callable[[Path, dict], None] | None = None,
) -> TrainSummary:
    """Train `adapter` (an AtlasResidual, a WeightLoRA, any method's trainable delta) on `data`
    with the objective `config.objective` names; checkpoints under `run_dir`.

    The backbone is frozen (requires_grad off, eval mode) and never changes.

    `caches`: prefix caches from `build_caches` to reuse (built here otherwise).
    `resume`: continue from the newest complete checkpoint in `run_dir` if there is one.
    `on_checkpoint(path, state)` is called after each checkpoint is in place.
    """
    run_dir = Path(run_dir)
    adapter = as_adapter(adapter)
    adapter.to(next(model.parameters()).device)
    params = [p for _, p in adapter.named_trainable()]
    _freeze_backbone(model, params)
    objective = methods.objective(config.objective.kind)(config.objective)
    if objective.uses_retained and data.retained is None:
        raise ValueError(f"objective.kind: {config.objective.kind!r} needs retained data, got none")
    run_hash = config_hash(
        config.fingerprint(), adapter.describe(), {k: s.fingerprint() for k, s in data.sets().items()}
    )
    layer = adapter.cache_layer if config.prefix_cache else None
    caches = _caches(model, data, layer, config, caches)
    n_batches = len(epoch_batches(data.train.lengths, config.batch_size, config.seed, 0, config.bucket_batches))
    run = Run(model, adapter, data, caches, config, n_batches)
    reported = objective.setup(run)  # once per run: STM's mask, Output-KL's teacher cache

    optimizer = torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )
    steps_per_epoch = math.ceil(n_batches / config.grad_accum)
    total_steps = config.epochs * steps_per_epoch
    state, resumed_from = _start(run_dir, run_hash, adapter, optimizer, config.seed, resume)

    def checkpoint(epoch_end: bool) -> None:
        nonlocal started
        paused = time.perf_counter()
        if data.val is not None and (epoch_end or config.validate_every_checkpoint):
            state["val_losses"][str(state["step"])] = mean_loss(
                model, adapter, data.val, caches.get("val"), data.pad_id, config.cache_batch_size
            )
            if (own := objective.validation_loss(run)) is not None:  # STM, TALR: their own loss too
                state.setdefault("val_objective", {})[str(state["step"])] = own
        state["finished"] = state["step"] == total_steps
        name = str(checkpoint_dir(run_dir) / f"step-{state['step']:06d}")
        if name not in state["checkpoints"]:  # listed in its own state.json too
            state["checkpoints"].append(name)
        path = write_checkpoint(run_dir, adapter, optimizer, {**state, "epoch_end": epoch_end})
        if on_checkpoint is not None:
            on_checkpoint(path, state)
        started += time.perf_counter() - paused  # validation and checkpoint writing are not training time

    bar = tqdm(total=total_steps, initial=state["step"], desc="train", unit="step", disable=not config.progress)
    started = time.perf_counter() - state["seconds"]
    for epoch in range(state["epoch"], config.epochs):
        batches = epoch_batches(data.train.lengths, config.batch_size, config.seed, epoch, config.bucket_batches)
        for s in range(state["step_in_epoch"], steps_per_epoch):
            first = s * config.grad_accum
            group = [
                (first + j, collate(data.train, b, data.pad_id))
                for j, b in enumerate(batches[first : first + config.grad_accum])
            ]
            lr = lr_at(state["step"], total_steps, config)
            for g in optimizer.param_groups:
                g["lr"] = lr
            loss_value = 0.0
            for loss in objective.losses(run, group, epoch):  # one per micro-batch
                if not torch.isfinite(loss):
                    _diverged(run_dir, state, f"loss is {float(loss.detach())}")
                loss.backward()
                loss_value += float(loss.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip if config.grad_clip else float("inf"))
            if not torch.isfinite(grad_norm):
                _diverged(run_dir, state, f"gradient norm is {float(grad_norm)}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            state["step_in_epoch"] = s + 1
            state["tokens"] += sum(int(b.mask.sum()) for _, b in group)
            state["train_losses"].append(loss_value)
            state["seconds"] = time.perf_counter() - started
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss_value:.4f}", tok_s=f"{state['tokens'] / state['seconds']:.0f}")
            if (
                config.checkpoint_every_steps
                and state["step"] % config.checkpoint_every_steps == 0
                and s + 1 < steps_per_epoch
            ):
                checkpoint(epoch_end=False)
        state["epoch"], state["step_in_epoch"] = epoch + 1, 0
        state["seconds"] = time.perf_counter() - started
        checkpoint(epoch_end=True)
    bar.close()
    summary = replace(summarize(run_dir, state, data, layer, resumed_from), **reported)
    summary.budget = adapter.budget() if hasattr(adapter, "budget") else None
    if config.progress:
        print(summary.format())
    return summary


def _caches(model, data: TrainData, layer, config: TrainConfig, caches) -> dict[str, PrefixCache]:
    """The prefix caches given (checked against the adapter's layer), else built now."""
    if caches is None:
        return build_caches(model, data, layer, config.cache_batch_size)
    if layer is not None and any(c.layer != layer for c in caches.values()):
        raise ValueError(
            f"caches: built at layer {[c.layer for c in caches.values()]}, the adapter needs layer {layer}"
        )
    return caches


def _start(run_dir: Path, run_hash: str, adapter, optimizer, seed: int, resume: bool) -> tuple[dict, str | None]:
    """(the run's state, the checkpoint it resumes from): a fresh state, or the newest complete checkpoint's."""
    state = {
        "step": 0,
        "epoch": 0,
        "step_in_epoch": 0,
        "seed": seed,
        "config_hash": run_hash,
        "tokens": 0,
        "seconds": 0.0,
        "train_losses": [],
        "val_losses": {},
        "checkpoints": [],
        "finished": False,
    }
    clean_temporary(run_dir)
    last = latest_checkpoint(run_dir) if resume else None
    if last is not None:
        if read_state(last)["config_hash"] != run_hash:
            raise ValueError(
                f"run_dir: {run_dir} holds a run with another config or data (config hash differs); "
                "use a new run_dir or resume=False"
            )
        return load_checkpoint(last, adapter, optimizer), str(last)
    if resume is False and latest_checkpoint(run_dir) is not None:
        raise ValueError(f"run_dir: {run_dir} already holds checkpoints; pass resume=True or use a new folder")
    return state, None


def _diverged(run_dir: Path, state: dict, what: str):
    last = latest_checkpoint(run_dir)
    message = (
        f"training diverged at step {state['step'] + 1} (epoch {state['epoch']}): {what}. "
        f"Last good checkpoint: {last if last is not None else 'none (the run had not checkpointed yet)'}. "
        "Try a lower learning rate or gradient clipping."
    )
    atomic_write_json(
        run_dir / "failed.json",
        {"error": message, "step": state["step"] + 1, "last_checkpoint": None if last is None else str(last)},
    )
    raise TrainingDiverged(message)
