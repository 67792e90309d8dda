"""bench/repro/token_loss_share.py: the hard tokens' share of each objective's loss, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from bench.repro.token_loss_share import loss_shares


def test_shares_by_hand() -> None:
    # ln 2.5 = 0.916: tokens 2.0 and 1.0 are hard, 0.5, 0.1 and 0.2 are not
    nll = [torch.tensor([2.0, 0.5]), torch.tensor([0.1]), torch.tensor([1.0, 0.2])]
    shares = loss_shares(nll, [[0, 1], [2]])
    assert shares["tokens"] == pytest.approx(2 / 5)
    assert shares["ce"] == pytest.approx(3.0 / 3.8)

    # TALR per batch: tau = median of per-sequence means; batch 1: means 1.25, 0.1 -> tau 0.675
    # (torch.quantile: the mean of the two middle values); batch 2: one sequence, tau 0.6
    def wl(losses, tau):
        w = [math.exp(-x / tau) for x in losses]
        return [wi * len(losses) / sum(w) * x for wi, x in zip(w, losses)]

    b1, b2 = wl([2.0, 0.5, 0.1], 0.675), wl([1.0, 0.2], 0.6)
    assert shares["talr"] == pytest.approx((b1[0] + b2[0]) / (sum(b1) + sum(b2)), rel=1e-5)
    assert shares["talr"] < shares["ce"] and shares["stm"] == 0.0
    assert loss_shares(nll, [[0, 1], [2]], tau=10.0)["ce"] == 0.0  # nothing is hard at perplexity 10


def test_no_tokens_is_an_error() -> None:
    with pytest.raises(ValueError, match="no response tokens"):
        loss_shares([torch.tensor([])], [[0]])
