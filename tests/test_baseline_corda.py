"""CorDA-KPM through PEFT: the base model at init, the init PEFT itself computes from the retained
contexts (our stored covariance is PEFT's), and the original weight kept bit-identical."""

import torch

from atlas_core.train.baselines.corda import CordaKPM
from atlas_core.train.retained_stats import collect_stats
from tests.baseline_fixtures import LAYER, batch, build, logits, o_proj, retained_ids, stats_for, tiny, train_steps

MODULE = f"model.layers.{LAYER}.self_attn.o_proj"


def contexts():
    """Retained contexts without the BOS token: with it, every sequence's max input is BOS's value
    vector and PEFT's per-sequence scaling would be one global factor (any covariance would pass)."""
    return [s[1:] for s in retained_ids(6)]


def peft_native(model, seqs, rank, covariance_file=None):
    """PEFT's own route: preprocess_corda with run_model feeding the retained contexts one by one
    (batch size 1, unpadded, as its hook expects), then injection; returns (A0, B0, rewritten W)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora.config import CordaConfig
    from peft.tuners.lora.corda import preprocess_corda

    corda = CordaConfig(corda_method="kpm", verbose=False, covariance_file=covariance_file)
    config = LoraConfig(
        r=rank,
        lora_alpha=float(rank),
        target_modules=[MODULE],
        lora_dropout=0.0,
        init_lora_weights="corda",
        corda_config=corda,
    )

    def run_model():
        for s in seqs:
            model(input_ids=s[None])

    preprocess_corda(model, config, run_model=run_model)
    inject_adapter_in_model(config, model)
    layer = model.get_submodule(MODULE)
    return (
        layer.lora_A["default"].weight.detach(),
        layer.lora_B["default"].weight.detach(),
        layer.base_layer.weight.detach(),
    )


def test_adapted_model_equals_base_at_init():
    model = tiny()
    ids, mask = batch()
    base = logits(model, ids, mask)
    adapter, _ = build(model, "corda-kpm")
    assert isinstance(adapter, CordaKPM) and adapter.lora_B.abs().max() > 1e-3
    torch.testing.assert_close(logits(model, ids, mask), base, rtol=0, atol=1e-5)
    adapter.remove()


def test_stored_covariance_is_the_one_peft_collects(tmp_path):
    seqs = contexts()
    stats = collect_stats(tiny(), LAYER, seqs)
    peft_native(tiny(), seqs, 4, covariance_file=str(tmp_path / "cov.pt"))
    theirs = torch.load(tmp_path / "cov.pt")[MODULE].double()
    torch.testing.assert_close(stats.cov_corda, theirs, rtol=1e-5, atol=1e-7)


def test_init_equals_peft_corda_on_the_retained_contexts():
    """Relative Frobenius error < 1e-2 (measured 2.6e-3: PEFT sums in fp32, we in fp64; the smallest
    components are ill-conditioned). Feeding the raw X^T X or LoRA-Null's scaling instead: 2-3e-2."""
    seqs = contexts()
    model, native_model = tiny(), tiny()
    W = o_proj(model).weight.detach().clone()
    adapter, _ = build(model, "corda-kpm", stats=collect_stats(model, LAYER, seqs))
    A0, B0, W_rewritten = peft_native(native_model, seqs, 4)
    s = adapter.scaling
    ours, theirs = s * adapter.B0 @ adapter.A0, s * B0 @ A0
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-2
    torch.testing.assert_close(W_rewritten, W - s * B0 @ A0, rtol=0, atol=1e-5)  # what PEFT does to W ...
    assert torch.equal(o_proj(model).base_layer.weight, W)  # ... and what we keep instead: W itself
    adapter.remove()


def test_kpm_takes_the_smallest_components():
    """The mutation IPM (largest components) gives another init: the test above would see it."""
    model = tiny()
    stats = stats_for(model, 6)
    adapter, _ = build(model, "corda-kpm", stats=stats)
    W = o_proj(model).base_layer.weight.detach().double()
    C = stats.cov_corda.double()
    C = C + torch.eye(len(C), dtype=C.dtype) * C.diag().mean() * 0.01  # PEFT's first damping
    U, S, Vh = torch.linalg.svd(W @ C, full_matrices=False)
    smallest = U[:, -4:] @ torch.diag(S[-4:]) @ Vh[-4:] @ torch.linalg.inv(C)
    largest = U[:, :4] @ torch.diag(S[:4]) @ Vh[:4] @ torch.linalg.inv(C)
    got = adapter.scaling * adapter.B0.double() @ adapter.A0.double()
    assert float((got - smallest).norm() / smallest.norm()) < 1e-2  # PEFT decomposes in fp32 (measured 3e-3)
    assert float((got - largest).norm() / largest.norm()) > 0.5
    adapter.remove()


def test_training_and_removal_leave_the_backbone_bit_identical(tmp_path):
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask = batch()
    base = logits(model, ids, mask)
    adapter, rc = build(model, "corda-kpm")
    with adapter.disabled():  # f0 with the adapter off is the base (W was put back)
        assert torch.equal(logits(model, ids, mask), base)
    train_steps(model, adapter, rc, tmp_path)
    assert (logits(model, ids, mask) - base).abs().max() > 1e-4
    adapter.remove()
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
