"""Losses: target cross-entropy on response tokens, and the retained-data terms of the
objective baselines (spec section 4):

    ce          L = CE(target responses)
    replay      L = CE(target responses) + replay_weight * CE(retained text)
    output-kl   L = CE(target responses) + beta * KL(f0 || f) on retained contexts

Every term is a sum over supervised positions divided by the positions of the whole
optimizer step (all its micro-batches), so gradient accumulation equals one large batch.
f0 is frozen, so its log-probabilities on the retained contexts are cached once when they
fit in `teacher_cache_mib`; otherwise they are recomputed each step without gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ObjectiveConfig
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
    model: nn.Module, adapter, data: TokenizedSet, cache: PrefixCache | None, pad_id: int, batch_size: int = 16
) -> float:
    """Mean token cross-entropy over a whole set (validation loss), longest examples first."""
    order = torch.sort(data.lengths, descending=True, stable=True).indices.tolist()
    total, count = 0.0, 0
    for start in range(0, len(order), batch_size):
        batch = collate(data, order[start : start + batch_size], pad_id)
        total += float(ce_sum(model, adapter, batch, cache))
        count += batch.num_targets
    return total / count


class RetainedTerm:
    """The retained-data term of Replay or Output-KL for one run."""

    def __init__(
        self,
        config: ObjectiveConfig,
        data: TokenizedSet,
        cache: PrefixCache | None,
        batch_size: int,
        seed: int,
        pad_id: int,
    ):
        self.config, self.data, self.cache, self.seed, self.pad_id = config, data, cache, seed, pad_id
        self.per_batch = max(1, round(config.ratio * batch_size))
        self.weight = config.replay_weight if config.kind == "replay" else config.beta
        self.teacher: list[torch.Tensor] | None = None

    def batch(self, micro_step: int) -> Batch:
        index = retained_indices(len(self.data), self.per_batch, self.seed, micro_step)
        return collate(self.data, index, self.pad_id, all_positions=self.config.kind == "output-kl")

    @torch.no_grad()
    def cache_teacher(self, model: nn.Module, adapter, vocab_size: int) -> bool:
        """Cache f0's log-probs at every real retained position if they fit; returns whether cached."""
        if self.config.kind != "output-kl":
            return False
        positions = int(self.data.lengths.sum())
        if positions * vocab_size * 4 > self.config.teacher_cache_mib * 2**20:
            return False
        teacher: list[torch.Tensor | None] = [None] * len(self.data)
        for start in range(0, len(self.data), 8):
            index = list(range(start, min(start + 8, len(self.data))))
            batch = collate(self.data, index, self.pad_id, all_positions=True)
            logp = self._teacher_logp(model, adapter, batch)
            counts = (batch.targets != -100).sum(1).tolist()
            for i, chunk in zip(index, logp.split(counts)):
                teacher[i] = chunk.cpu()
        self.teacher = teacher
        return True

    def _teacher_logp(self, model, adapter, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            logits, _ = selected_logits(model, adapter, batch, self.cache, enabled=False)
        return torch.log_softmax(logits, -1)

    def positions(self, batch: Batch) -> int:
        return batch.num_targets

    def loss_sum(self, model: nn.Module, adapter, batch: Batch) -> torch.Tensor:
        """Unweighted sum over the batch's positions: CE (Replay) or KL(f0 || f) (Output-KL)."""
        logits, targets = selected_logits(model, adapter, batch, self.cache)
        if self.config.kind == "replay":
            return F.cross_entropy(logits, targets, reduction="sum")
        if self.teacher is not None:
            p0 = torch.cat([self.teacher[i] for i in batch.index]).to(logits.device)
        else:
            p0 = self._teacher_logp(model, adapter, batch)
        return F.kl_div(torch.log_softmax(logits, -1), p0, log_target=True, reduction="sum")
