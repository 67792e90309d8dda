"""TALR, token-adaptive loss reweighting (Lin et al., ICLR 2026, arXiv 2509.20758; no official code).

Every step, from the CURRENT model's response-token NLLs l_t (stop-gradient):

    tau   = median over the batch's sequences of their mean response NLL
    w_t   proportional to exp(-l_t / tau)                      hard tokens weigh less
    loss  = sum_t w_t l_t   (with gradient through l_t only)

(choice) w is normalised over the batch's response tokens to sum to their count, so the loss
has plain CE's scale; the batch is the micro-batch; the median of an even count is the mean
of the two middle values (torch.quantile 0.5). softmax(-l / tau) * N computes it stably.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...methods import register_objective
from ..data import Batch
from ..objectives import Objective, Run, mean_loss, selected_logits


def talr_weights(nll: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Weights (N,) of the tokens with NLLs `nll` (N,) in batch rows `rows` (N,), detached."""
    if nll.ndim != 1 or rows.shape != nll.shape:
        raise ValueError(f"talr: expected nll (N,) and rows (N,), got {tuple(nll.shape)} and {tuple(rows.shape)}")
    nll = nll.detach().float()
    if nll.numel() == 0:
        return nll
    present, row = torch.unique(rows, return_inverse=True)
    per_seq = torch.zeros(len(present), device=nll.device).index_add_(0, row, nll)
    per_seq = per_seq / torch.bincount(row, minlength=len(present)).float()  # mean response NLL per sequence
    tau = torch.quantile(per_seq, 0.5).clamp_min(1e-6)
    return torch.softmax(-nll / tau, 0) * nll.numel()  # sums to the token count


def talr_sum(model, adapter, batch: Batch, cache) -> torch.Tensor:
    """sum_t w_t l_t over the batch's response tokens (the trainer divides by the step's tokens)."""
    logits, targets = selected_logits(model, adapter, batch, cache)
    nll = F.cross_entropy(logits, targets, reduction="none")  # (N,)
    rows = (batch.targets != -100).nonzero()[:, 0].to(nll.device)  # (N,) row of each supervised position
    return (talr_weights(nll, rows) * nll).sum()


class TALR(Objective):
    """CE reweighted token-wise by the current model's NLL (talr_sum)."""

    kind = "talr"

    def target_sum(self, run: Run, batch: Batch) -> torch.Tensor:
        return talr_sum(run.model, run.adapter, batch, run.cache("train"))

    def validation_loss(self, run: Run) -> float | None:
        """sum_t w_t l_t / N over the validation set, batched as the CE validation loss is."""
        batch_size = run.config.cache_batch_size
        return mean_loss(
            run.model, run.adapter, run.data.val, run.cache("val"), run.data.pad_id, batch_size, loss_sum=talr_sum
        )


register_objective(TALR)
