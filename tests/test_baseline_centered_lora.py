"""The centered LoRA control: out = W x + s B A (x - mu) with mu the retained mean o_proj input,
trainable and frozen forms equal, and no plain-LoRA export of it."""

import pytest
import torch

from atlas_core.chain import load_delta
from atlas_core.errors import InputError
from atlas_core.methods import get
from tests.baseline_fixtures import LAYER, batch, build, logits, o_proj, stats_for, tiny


def test_update_is_lora_of_the_mean_subtracted_input():
    model = tiny()
    stats = stats_for(model)
    adapter, _ = build(model, "centered-lora", stats=stats)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=g))
    x = torch.randn(2, 5, adapter.lora_A.shape[1], generator=g)  # (B, T, d_in)
    W = adapter.base_weight()
    mu = stats.mean.float()
    want = x @ W.T + adapter.scaling * (x - mu) @ adapter.lora_A.detach().T @ adapter.lora_B.detach().T
    with torch.no_grad():
        got = o_proj(model)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (mu.abs().max() > 1e-3) and adapter.stats_key == stats.key  # mu is not zero: the test can tell
    adapter.remove()


def test_the_retained_mean_input_is_not_moved_at_o_proj():
    """At x = mu the update is exactly zero: the retained common mode passes o_proj unchanged."""
    model = tiny()
    stats = stats_for(model)
    adapter, _ = build(model, "centered-lora", stats=stats)
    with torch.no_grad():
        adapter.lora_B.normal_()
        mu = stats.mean.float()[None]
        torch.testing.assert_close(o_proj(model)(mu), mu @ adapter.base_weight().T, rtol=0, atol=1e-5)
    adapter.remove()


def test_saved_delta_is_refused_as_a_plain_lora(tmp_path):
    model = tiny()
    adapter, _ = build(model, "centered-lora")
    path = tmp_path / "adapter.safetensors"
    adapter.save(path, {})
    adapter.remove()
    delta = load_delta(path, lambda sha: None)
    assert delta.kind == "centered-lora" and delta.layer == LAYER
    with pytest.raises(InputError, match="centered-lora delta, which is no plain LoRA"):
        get("centered-lora").delta.loras(delta, "release v1")
    ids, mask = batch()
    base = logits(model, ids, mask)
    with delta.attached(model):  # B = 0: the saved untrained delta changes nothing
        assert torch.equal(logits(model, ids, mask), base)


def test_needs_the_retained_statistics():
    from atlas_core.train.baselines.centered_lora import CenteredLoRA

    with pytest.raises(ValueError, match="retained statistics"):
        CenteredLoRA(tiny(), LAYER, 4, 4.0, "self_attn.o_proj", 0)
