"""bench/repro/retained_energy.py: the diagnostic behind RESULTS.md's O-LoRA paragraph."""

import torch

from bench.repro.retained_energy import through_a, update_energy


def test_through_a_is_one_for_isotropic_inputs_and_zero_off_their_span():
    A = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert abs(through_a(A, torch.eye(8, dtype=torch.float64)) - 1.0) < 1e-12
    C = torch.zeros(8, 8, dtype=torch.float64)
    C[:2, :2] = torch.tensor([[2.0, 1.0], [1.0, 3.0]])  # the retained inputs span the first two axes
    A_off = A.clone()
    A_off[:, :2] = 0  # rows orthogonal to that span
    assert through_a(A_off, C) == 0.0
    A_on = torch.zeros(1, 8, dtype=torch.float64)
    A_on[0, 1] = 5.0  # all of A on axis 1, which holds 3 of tr(C) = 5: 3 / (1 * 5 / 8)
    assert abs(through_a(A_on, C) - 4.8) < 1e-12


def test_update_energy_is_the_energy_of_the_update_on_the_inputs():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(50, 6, generator=g, dtype=torch.float64)  # (N, d_in)
    A = torch.randn(2, 6, generator=g, dtype=torch.float64)
    B = torch.randn(5, 2, generator=g, dtype=torch.float64)
    by_hand = (0.5 * X @ A.T @ B.T).square().sum()  # sum_n ||s B A x_n||^2
    assert abs(update_energy(A, B, 0.5, X.T @ X) - float(by_hand)) < 1e-9 * float(by_hand)
