"""bench/repro/mean_share.py: the shared-mean diagnostic behind RESULTS.md's centering paragraph."""

import torch

from bench.repro.mean_share import mean_share, typical


def test_mean_share_is_one_for_identical_rows_and_zero_for_opposite_ones():
    v = torch.tensor([[3.0, 4.0]])
    assert mean_share(v.repeat(5, 1)) == 1.0
    assert mean_share(torch.cat([v, -v])) == 0.0
    # a mean of norm 1 under noise of rms norm 1 (2-d, std 1/sqrt 2 each): share about 1/2
    x = torch.tensor([1.0, 0.0]) + torch.randn(20000, 2, generator=torch.Generator().manual_seed(0)) / 2**0.5
    assert abs(mean_share(x) - 0.5) < 0.02


def test_typical_drops_only_massive_rows():
    x = torch.randn(100, 8, generator=torch.Generator().manual_seed(0))
    massive = torch.full((2, 8), 1000.0)
    kept = typical(torch.cat([x, massive]))
    assert kept.shape == (100, 8) and torch.equal(kept, x)
