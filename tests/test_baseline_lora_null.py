"""LoRA-Null: the null-space init of the retained covariance, the base model unchanged at init,
v1 (A and B train) and v2 (A frozen, rank 2r)."""

import pytest
import torch

from atlas_core.backbone import decoder_layers
from atlas_core.train.baselines.lora_null import LoRANull
from tests.baseline_fixtures import LAYER, batch, build, logits, retained_ids, stats_for, tiny, train_steps


def o_proj_inputs(model, seqs) -> torch.Tensor:
    """X_ret (N, d_in): every o_proj input at layer l on `seqs`, by a hook of the test's own."""
    seen = []
    h = decoder_layers(model)[LAYER].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0][0]))
    with torch.no_grad():
        for s in seqs:
            model(input_ids=s[None])
    h.remove()
    return torch.cat(seen)


@pytest.mark.parametrize("method", ["lora-null", "lora-null-v2"])
def test_adapted_model_equals_base_at_init(method):
    model = tiny()
    ids, mask = batch()
    base = logits(model, ids, mask)
    adapter, _ = build(model, method)
    assert adapter.lora_B.abs().max() > 1e-3  # not a B = 0 init: the equality is the subtraction's
    torch.testing.assert_close(logits(model, ids, mask), base, rtol=0, atol=1e-5)
    adapter.remove()


def test_init_is_the_null_space_svd_of_the_spec():
    """s B0 A0 = W N N^T, N = the r smallest eigenvectors of sum_seq (X/max|X|)^T (X/max|X|)."""
    model = tiny()
    seqs = retained_ids(6)
    W = decoder_layers(model)[LAYER].self_attn.o_proj.weight.detach().double()
    C = sum((x / x.abs().max()).T @ (x / x.abs().max()) for x in (o_proj_inputs(model, [s]).double() for s in seqs))
    N = torch.linalg.eigh(C).eigenvectors[:, :4]
    adapter, _ = build(model, "lora-null", stats=stats_for(model, 6))
    got = adapter.scaling * adapter.B0.double() @ adapter.A0.double()
    torch.testing.assert_close(got, W @ N @ N.T, rtol=0, atol=1e-5)
    adapter.remove()


def test_A_maps_the_retained_calibration_inputs_to_zero():
    """With fewer retained tokens than d_in - r the null space is exact: ||X A^T|| / (||X|| ||A||) < 1e-5
    (measured ~1e-8). A random A, or the LARGEST eigenvectors, give ~0.1 or more."""
    model = tiny()
    seqs = retained_ids(2)  # 2 contexts, fewer tokens than d_in - r = 60
    X = o_proj_inputs(model, seqs)  # (N, 64)
    assert X.shape[0] < 60
    adapter, _ = build(model, "lora-null", stats=stats_for(model, 2))

    def rel(A):
        return float((X @ A.T).norm() / (X.norm() * A.norm()))

    assert rel(adapter.lora_A.detach()) < 1e-5
    assert rel(torch.randn_like(adapter.lora_A)) > 1e-2
    C = X.double().T @ X.double()
    top = torch.linalg.eigh(C).eigenvectors[:, -4:].T.float()  # the mutation: largest instead of smallest
    assert rel(top) > 1e-1
    adapter.remove()


def test_v2_freezes_A_and_runs_at_twice_the_rank(tmp_path):
    model = tiny()
    adapter, rc = build(model, "lora-null-v2", rank=4)
    assert isinstance(adapter, LoRANull) and adapter.rank == 8 and adapter.budget_rank == 4
    assert [n for n, _ in adapter.named_trainable()] == ["lora_B"]
    A_before = adapter.lora_A.detach().clone()
    B_before = adapter.lora_B.detach().clone()
    train_steps(model, adapter, rc, tmp_path)
    assert torch.equal(adapter.lora_A, A_before)  # frozen
    assert not torch.equal(adapter.lora_B, B_before)
    A, B = adapter.delta_factors()  # delta relative to the original W: s (B - B0) A0, rank r' = 2r
    assert A.shape[0] == 8 and torch.equal(A, adapter.A0)
    adapter.remove()


def test_training_moves_the_model_and_remove_restores_it(tmp_path):
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask = batch()
    base = logits(model, ids, mask)
    adapter, rc = build(model, "lora-null")
    train_steps(model, adapter, rc, tmp_path)
    assert (logits(model, ids, mask) - base).abs().max() > 1e-4
    adapter.remove()
    assert torch.equal(logits(model, ids, mask), base)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


def test_wrong_statistics_are_refused():
    model = tiny()
    with pytest.raises(ValueError, match="layer"):
        build(model, "lora-null", stats=stats_for(model, layer=0))
    with pytest.raises(ValueError, match="needs the retained statistics"):
        from atlas_core.train import build_adapter
        from tests.baseline_fixtures import run_config

        build_adapter(run_config("lora-null"), model)
