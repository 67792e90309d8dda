"""OPLoRA: after real training steps, W + Delta W keeps W's top-k singular triples exactly."""

import pytest
import torch

from tests.baseline_fixtures import build, o_proj, tiny, train_steps


def effective_weight(model) -> torch.Tensor:
    """W + Delta W (d_out, d_in) as the adapted o_proj computes it: its outputs on the unit vectors."""
    module = o_proj(model)
    d_in = module.base_layer.in_features
    with torch.no_grad():
        return module(torch.eye(d_in)).T  # column j = (W + Delta W) e_j


@pytest.mark.parametrize("hidden,k", [(64, 16), (160, 128)])  # 160 > 128: the paper's k = 128 fits
def test_top_k_singular_triples_survive_training(tmp_path, hidden, k):
    model = tiny(hidden=hidden, heads=4, layers=2)
    W = o_proj(model).weight.detach().double()
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    adapter, rc = build(model, "oplora", rank=4, k=k, lr=5e-2)
    train_steps(model, adapter, rc, tmp_path)
    M = effective_weight(model).double()
    delta = M - W
    assert delta.abs().max() > 1e-3  # training moved the weight
    scale = float(S[0])
    for i in range(k):
        torch.testing.assert_close(M @ Vh[i], S[i] * U[:, i], rtol=0, atol=1e-5 * scale)  # (W + dW) v_i = s_i u_i
        torch.testing.assert_close(U[:, i] @ M, S[i] * Vh[i], rtol=0, atol=1e-5 * scale)  # u_i^T (W + dW) = s_i v_i^T
    # the saved factors are the same update: W + s (P_L B)(A P_R)
    A, B = adapter.delta_factors()
    torch.testing.assert_close(adapter.scaling * (B.double() @ A.double()), delta, rtol=0, atol=1e-5)
    adapter.remove()


def test_without_the_projections_the_property_fails(tmp_path):
    """The mutation: plain LoRA trained the same way moves v_1's image (so the test above can fail)."""
    model = tiny()
    W = o_proj(model).weight.detach().double()
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    adapter, rc = build(model, "weight-lora", rank=4, lr=5e-2)
    train_steps(model, adapter, rc, tmp_path)
    M = effective_weight(model).double()
    worst = max(float((M @ Vh[i] - S[i] * U[:, i]).abs().max()) for i in range(16))
    assert worst > 1e-3
    adapter.remove()


def test_k_must_fit_the_projection():
    model = tiny()
    with pytest.raises(ValueError, match="oplora.k"):
        build(model, "oplora", k=128)
    assert not hasattr(o_proj(model), "base_layer")  # the refused adapter left the model as it was
