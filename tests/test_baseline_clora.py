"""CLoRA: R = 1/2 ||A P_A||^2 + 1/2 ||B^T P_B||^2 with fixed random orthonormal P_A, P_B, lambda = 1."""

import pytest
import torch

from atlas_core.train.baselines.clora import clora_penalty
from tests.baseline_fixtures import build, tiny


def hand_penalty(A, B, P_A, P_B, lam):
    """Value and gradients by sums of squares over explicit entries: d/dA = lam A P_A P_A^T, d/dB = lam P_B P_B^T B."""
    A, B, P_A, P_B = (t.detach().double() for t in (A, B, P_A, P_B))
    value = 0.0
    for i in range(A.shape[0]):
        for j in range(P_A.shape[1]):
            value += 0.5 * float(A[i] @ P_A[:, j]) ** 2
    for i in range(B.shape[1]):
        for j in range(P_B.shape[1]):
            value += 0.5 * float(B[:, i] @ P_B[:, j]) ** 2
    return lam * value, lam * A @ P_A @ P_A.T, lam * P_B @ P_B.T @ B


@pytest.mark.parametrize("family,head_dim", [("llama", None), ("qwen3", 32)])  # square, and d_in = 128 != d_out = 64
def test_value_and_gradient_equal_a_hand_computation(family, head_dim):
    model = tiny(family=family, head_dim=head_dim)
    adapter, _ = build(model, "clora", rank=4)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        adapter.lora_A.copy_(torch.randn(adapter.lora_A.shape, generator=g))
        adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=g))
    value, grad_A, grad_B = hand_penalty(adapter.lora_A, adapter.lora_B, adapter.P_A, adapter.P_B, 1.0)
    penalty = adapter.penalty()
    penalty.backward()
    assert abs(float(penalty.detach()) - value) < 1e-4 * value
    torch.testing.assert_close(adapter.lora_A.grad.double(), grad_A, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(adapter.lora_B.grad.double(), grad_B, rtol=1e-4, atol=1e-5)
    adapter.remove()


def test_subspaces_are_orthonormal_seeded_and_sized():
    model = tiny()
    adapter, _ = build(model, "clora", rank=4)
    assert adapter.k == 32 == min(512, 64 // 2)  # (choice) k = min(512, d / 2)
    for P in (adapter.P_A, adapter.P_B):
        assert P.shape == (64, 32)
        torch.testing.assert_close(P.T @ P, torch.eye(32), rtol=0, atol=1e-5)
    again, _ = build(tiny(), "clora", rank=4)
    assert torch.equal(again.P_A, adapter.P_A) and torch.equal(again.P_B, adapter.P_B)  # fixed by the seed
    assert float(adapter.penalty().detach()) > 0  # A's random init is not orthogonal to P_A
    adapter.remove()
    again.remove()


def test_penalty_checks_shapes():
    with pytest.raises(ValueError, match="clora"):
        clora_penalty(torch.zeros(4, 8), torch.zeros(6, 4), torch.zeros(9, 2), torch.zeros(6, 2), 1.0)
