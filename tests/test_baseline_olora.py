"""O-LoRA: the regulariser lambda1 * sum |A_past A^T|, its gradient, A_past from the retained
covariance, and the trainer adding it once per optimizer step."""

import json

import pytest
import torch

from atlas_core.train.baselines.olora import olora_penalty
from tests.baseline_fixtures import build, stats_for, tiny, train_steps


def hand_penalty(A, A_past, lam):
    """lambda1 * sum_ij |a_past_i . a_j| and its gradient sum_i lambda1 sign(a_past_i . a_j) a_past_i, by loops."""
    value, grad = 0.0, torch.zeros_like(A, dtype=torch.float64)
    for i in range(A_past.shape[0]):
        for j in range(A.shape[0]):
            dot = float(A_past[i].double() @ A[j].double())
            value += lam * abs(dot)
            grad[j] += lam * (1.0 if dot > 0 else -1.0) * A_past[i].double()
    return value, grad


def test_value_and_gradient_equal_a_hand_computation():
    model = tiny()
    adapter, _ = build(model, "o-lora", rank=4)
    with torch.no_grad():  # a non-trivial A
        adapter.lora_A.copy_(torch.randn(adapter.lora_A.shape, generator=torch.Generator().manual_seed(3)))
    value, grad = hand_penalty(adapter.lora_A.detach(), adapter.A_past, 0.5)
    adapter.lora_A.grad = None
    penalty = adapter.penalty()
    penalty.backward()
    assert abs(float(penalty.detach()) - value) < 1e-4 * max(1.0, value)
    torch.testing.assert_close(adapter.lora_A.grad.double(), grad, rtol=1e-5, atol=1e-5)
    assert adapter.lora_B.grad is None or adapter.lora_B.grad.abs().max() == 0  # B is not regularised
    adapter.remove()


def test_past_subspace_is_the_top_r_eigenvectors_of_C():
    model = tiny()
    stats = stats_for(model)
    adapter, _ = build(model, "o-lora", rank=4, stats=stats)
    vals, vecs = torch.linalg.eigh(stats.cov)
    top = vecs[:, -4:].T.float()  # (r, d_in)
    P = adapter.A_past
    torch.testing.assert_close(P @ P.T, torch.eye(4), rtol=0, atol=1e-5)  # orthonormal rows
    torch.testing.assert_close((P.T @ P), top.T @ top, rtol=0, atol=1e-4)  # the same subspace
    adapter.remove()


def test_trainer_adds_the_penalty_once_per_step(tmp_path):
    """Step 1's loss = CE + penalty at the init (the train loss the trainer records)."""

    def first_loss(summary) -> float:
        return json.loads(open(summary.checkpoints[-1] + "/state.json").read())["train_losses"][0]

    model = tiny()
    adapter, rc = build(model, "o-lora", rank=4)
    penalty0 = float(adapter.penalty().detach())
    plain, rc_plain = build(tiny(), "weight-lora", rank=4)  # same seed: the same A, B = 0, the same first CE
    ce = first_loss(train_steps(plain.model, plain, rc_plain, tmp_path / "ce"))
    assert abs(first_loss(train_steps(model, adapter, rc, tmp_path / "olora")) - ce - penalty0) < 1e-4
    assert penalty0 > 1e-2
    adapter.remove()
    plain.remove()


def test_penalty_checks_shapes():
    with pytest.raises(ValueError, match="olora"):
        olora_penalty(torch.zeros(4, 8), torch.zeros(4, 9), 0.5)


def test_centered_past_subspace_is_the_top_r_eigenvectors_of_the_centered_covariance():
    """past: pca-centered (a control): the retained mean is taken out of C before its top-r directions."""
    from dataclasses import replace

    from atlas_core.train import build_adapter
    from tests.baseline_fixtures import run_config

    model = tiny()
    stats = stats_for(model)
    rc = run_config("o-lora", rank=4)
    rc = replace(rc, lora=replace(rc.lora, o_lora=replace(rc.lora.o_lora, past="pca-centered")))
    adapter = build_adapter(rc, model, stats=stats)
    centered = stats.cov - stats.tokens * torch.outer(stats.mean, stats.mean)
    top = torch.linalg.eigh(centered)[1][:, -4:].T.float()
    P = adapter.A_past
    torch.testing.assert_close(P.T @ P, top.T @ top, rtol=0, atol=1e-4)
    uncentered = torch.linalg.eigh(stats.cov)[1][:, -4:].T.float()
    assert (P.T @ P - uncentered.T @ uncentered).abs().max() > 1e-2  # not the uncentered subspace
    adapter.remove()
