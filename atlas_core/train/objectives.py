"""Losses: the objectives the trainer's loop calls, registered with atlas_core.methods by kind
(the run config's `train.objective.kind`). This module defines the base and the spec's
objectives (section 4); STM and TALR live in atlas_core/train/baselines/.

    ce          L = CE(target responses)
    replay      L = CE(target responses) + replay_weight * CE(retained text)
    output-kl   L = CE(target responses) + beta * KL(f0 || f) on retained contexts

Every term is a sum over supervised positions divided by the positions of the whole
optimizer step (all its micro-batches), so gradient accumulation equals one large batch; the
trained delta's regulariser (`adapter.penalty()`: O-LoRA, CLoRA) is added once per step.
f0 is frozen, so its log-probabilities on the retained contexts are cached once when they
fit in `teacher_cache_mib`; otherwise they are recomputed each step without gradients.

An objective plugin subclasses `Objective` (overriding `target_batch`, `target_sum`,
`extra_term` or `losses` itself) and registers it: `atlas_core.methods.register_objective(cls)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..methods import register_objective
from .data import Batch, TokenizedSet, collate, retained_indices
from .prefix_cache import PrefixCache, head_logits


def _inputs(batch: Batch, cache: PrefixCache | None, device):
    cached = cache.batch(batch.index, batch.ids.shape[1]).to(device) if cache is not None else None
    return batch.ids.to(device), batch.mask.to(device), batch.targets.to(device), cached


def selected_logits(model: nn.Module, adapter, batch: Batch, cache: PrefixCache | None, enabled: bool = True):
    """(logits (N, V) fp32 at the supervised positions, their targets (N,))."""
    device = next(model.parameters()).device
    ids, mask, targets, cached = _inputs(batch, cache, device)
    hidden = adapter.hidden(model, ids, mask, cached, enabled=enabled)
    sel = targets != -100
    return head_logits(model, hidden[sel]).float(), targets[sel]


def ce_sum(model: nn.Module, adapter, batch: Batch, cache: PrefixCache | None) -> torch.Tensor:
    logits, targets = selected_logits(model, adapter, batch, cache)
    return F.cross_entropy(logits, targets, reduction="sum")


@torch.no_grad()
def mean_loss(
    model: nn.Module,
    adapter,
    data: TokenizedSet,
    cache: PrefixCache | None,
    pad_id: int,
    batch_size: int = 16,
    target_batch: Callable[[Batch], Batch] | None = None,
    loss_sum: Callable[..., torch.Tensor] = ce_sum,
) -> float:
    """Mean per-token loss over a whole set, longest examples first: token cross-entropy (the
    validation loss), or an objective's own (`target_batch` drops positions, `loss_sum` weighs them:
    Objective.validation_loss)."""
    order = torch.sort(data.lengths, descending=True, stable=True).indices.tolist()
    total, count = 0.0, 0
    for start in range(0, len(order), batch_size):
        batch = collate(data, order[start : start + batch_size], pad_id)
        if target_batch is not None:
            batch = target_batch(batch)
        total += float(loss_sum(model, adapter, batch, cache))
        count += batch.num_targets
    if count == 0:
        raise ValueError(f"{data.name}: no supervised position left to average the loss over")
    return total / count


@dataclass
class Run:
    """What an objective sees of one training run."""

    model: nn.Module
    adapter: object  # the trainer's adapter interface (atlas_core.train.adapters)
    data: object  # atlas_core.train.trainer.TrainData
    caches: dict[str, PrefixCache]
    config: object  # atlas_core.train.config.TrainConfig
    batches_per_epoch: int

    def cache(self, name: str) -> PrefixCache | None:
        return self.caches.get(name)


class Objective:
    """The loss of one training run, built from its ObjectiveConfig (`config`); kind "ce" itself."""

    kind = "ce"
    uses_retained = False  # needs TrainData.retained
    own_fields: tuple[str, ...] = ()  # ObjectiveConfig fields only this kind reads (kept out of the others' run keys)

    def __init__(self, config) -> None:
        self.config = config

    def setup(self, run: Run) -> dict:
        """Once before the first step (also on resume); returns TrainSummary fields to set."""
        return {}

    def validation_loss(self, run: Run) -> float | None:
        """The target term's own loss per supervised token on the validation set, where it is not
        token CE (STM drops tokens, TALR weighs them); the trainer records it next to the CE
        validation loss and a learning-rate sweep may choose by it. None: the target term is CE."""
        return None

    def target_batch(self, batch: Batch) -> Batch:
        """The target micro-batch as the loss sees it."""
        return batch

    def target_sum(self, run: Run, batch: Batch) -> torch.Tensor:
        """Unnormalised loss of a target micro-batch: the sum over its supervised positions."""
        return ce_sum(run.model, run.adapter, batch, run.cache("train"))

    def extra_term(self, run: Run, group: list[tuple[int, Batch]], epoch: int) -> Callable[[int], torch.Tensor] | None:
        """A second term of the step (retained data): k -> its weighted value for micro-batch k; None: none."""
        return None

    def losses(self, run: Run, group: list[tuple[int, Batch]], epoch: int) -> Iterator[torch.Tensor]:
        """One loss per micro-batch of the optimizer step `group` ([(micro-batch index in the epoch, Batch)]);
        the trainer backpropagates each before asking for the next."""
        batches = [self.target_batch(b) for _, b in group]
        n_target = max(1, sum(b.num_targets for b in batches))  # STM may drop every token of a step
        extra = self.extra_term(run, group, epoch)
        penalty = getattr(run.adapter, "penalty", lambda: None)
        for k, batch in enumerate(batches):
            loss = self.target_sum(run, batch) / n_target
            if extra is not None:
                loss = loss + extra(k)
            if k == 0 and (reg := penalty()) is not None:  # once per optimizer step
                loss = loss + reg
            yield loss


class Replay(Objective):
    """+ replay_weight * CE on retained examples, `ratio` of them per target example in each micro-batch."""

    kind = "replay"
    uses_retained = True
    all_positions = False  # retained examples are supervised where their targets say

    @property
    def weight(self) -> float:
        return self.config.replay_weight

    def setup(self, run: Run) -> dict:
        self.per_batch = max(1, round(self.config.ratio * run.config.batch_size))
        return {}

    def retained_batch(self, run: Run, micro_step: int) -> Batch:
        data = run.data.retained
        index = retained_indices(len(data), self.per_batch, run.config.seed, micro_step)
        return collate(data, index, run.data.pad_id, all_positions=self.all_positions)

    def retained_sum(self, run: Run, batch: Batch) -> torch.Tensor:
        """Unweighted sum over the batch's positions."""
        logits, targets = selected_logits(run.model, run.adapter, batch, run.cache("retained"))
        return F.cross_entropy(logits, targets, reduction="sum")

    def extra_term(self, run: Run, group: list[tuple[int, Batch]], epoch: int) -> Callable[[int], torch.Tensor]:
        extra = [self.retained_batch(run, epoch * run.batches_per_epoch + j) for j, _ in group]
        n_extra = sum(b.num_targets for b in extra)
        return lambda k: self.weight * self.retained_sum(run, extra[k]) / n_extra


class OutputKL(Replay):
    """+ beta * KL(f0 || f) at every position of retained contexts."""

    kind = "output-kl"
    all_positions = True

    @property
    def weight(self) -> float:
        return self.config.beta

    def setup(self, run: Run) -> dict:
        super().setup(run)
        self.teacher: list[torch.Tensor] | None = None
        vocab_size = run.model.get_output_embeddings().weight.shape[0]
        return {"teacher_cached": self.cache_teacher(run, vocab_size)}

    @torch.no_grad()
    def cache_teacher(self, run: Run, vocab_size: int) -> bool:
        """Cache f0's log-probs at every real retained position if they fit; returns whether cached."""
        data = run.data.retained
        positions = int(data.lengths.sum())
        if positions * vocab_size * 4 > self.config.teacher_cache_mib * 2**20:
            return False
        teacher: list[torch.Tensor | None] = [None] * len(data)
        for start in range(0, len(data), 8):
            index = list(range(start, min(start + 8, len(data))))
            batch = collate(data, index, run.data.pad_id, all_positions=True)
            logp = self._teacher_logp(run, batch)
            counts = (batch.targets != -100).sum(1).tolist()
            for i, chunk in zip(index, logp.split(counts)):
                teacher[i] = chunk.cpu()
        self.teacher = teacher
        return True

    def _teacher_logp(self, run: Run, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            logits, _ = selected_logits(run.model, run.adapter, batch, run.cache("retained"), enabled=False)
        return torch.log_softmax(logits, -1)

    def retained_sum(self, run: Run, batch: Batch) -> torch.Tensor:
        logits, _ = selected_logits(run.model, run.adapter, batch, run.cache("retained"))
        if self.teacher is not None:
            p0 = torch.cat([self.teacher[i] for i in batch.index]).to(logits.device)
        else:
            p0 = self._teacher_logp(run, batch)
        return F.kl_div(torch.log_softmax(logits, -1), p0, log_target=True, reduction="sum")


for _objective in (Objective, Replay, OutputKL):
    register_objective(_objective)
