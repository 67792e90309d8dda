"""Version chains: deltas applied in order, frozen Weight-LoRA hooks, verified loading, clean detach."""

import pytest
import torch

from atlas_core.backbone import decoder_layers, full_hidden, hidden_at_layer
from atlas_core.chain import Chain, FrozenLoRA, load_delta
from atlas_core.io import IntegrityError
from atlas_core.residual import ResidualConfig, attach, build_residual, save_adapter
from atlas_core.train import WeightLoRA
from tests.test_residual import atlas_for


def trained_residual(model, seed, variant="plain", layer=2, atlas=None):
    r = build_residual(ResidualConfig(variant=variant, layer=layer, rank=4, seed=seed), model, atlas)
    with torch.no_grad():  # B = 0 would make every delta vanish; give it a random, non-trivial value
        r.B.copy_(torch.randn(r.B.shape, generator=torch.Generator().manual_seed(seed + 100)) * 0.5)
    return r


def trained_lora(model, seed, layer=1):
    lora = WeightLoRA(model, layer, rank=4, alpha=8.0, seed=seed)
    with torch.no_grad():
        lora.lora_B.copy_(torch.randn(lora.lora_B.shape, generator=torch.Generator().manual_seed(seed + 200)))
    return lora


def saved_atlas(tmp_path):
    atlas = atlas_for("local", layer=2)
    atlas.save(tmp_path / "atlas.safetensors")  # gives it the sha256 adapters record
    return atlas


def no_hooks(model) -> bool:
    return all(not m._forward_hooks for m in model.modules())


def test_residuals_at_one_layer_apply_in_chain_order(tiny, tokens):
    ids, mask = tokens
    r1, r2 = trained_residual(tiny, 1), trained_residual(tiny, 2)
    h = hidden_at_layer(tiny, 2, ids, mask)  # (B, T, d)
    h1 = h + r1(h)
    expected = h1 + r2(h1)  # r2 sees r1's output: the chain's meaning
    with torch.no_grad(), Chain([r1, r2]).attached(tiny):
        got = hidden_at_layer(tiny, 2, ids, mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    swapped = h + r2(h)
    assert (swapped + r1(swapped) - expected).abs().max() > 1e-3  # the order is observable
    assert no_hooks(tiny)


def test_attach_order_holds_for_a_candidate_attached_after_the_chain(tiny, tokens):
    ids, mask = tokens
    r1, r2 = trained_residual(tiny, 1), trained_residual(tiny, 2)
    with torch.no_grad():
        with Chain([r1, r2]).attached(tiny):
            want = full_hidden(tiny, ids, mask)
        with Chain([r1]).attached(tiny), attach(tiny, r2):  # training a delta on top of its parent
            got = full_hidden(tiny, ids, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_frozen_lora_equals_peft_lora(tiny, tokens, tmp_path):
    ids, mask = tokens
    with torch.no_grad():
        base = full_hidden(tiny, ids, mask)
        lora = trained_lora(tiny, 0)
        want = full_hidden(tiny, ids, mask)
        lora.save(tmp_path / "lora.safetensors", {})
        lora.remove()
        frozen = FrozenLoRA.load(tmp_path / "lora.safetensors")
        with frozen.attached(tiny):
            got = full_hidden(tiny, ids, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - base).abs().max() > 1e-3
        torch.testing.assert_close(full_hidden(tiny, ids, mask), base, rtol=0, atol=0)
    assert no_hooks(tiny)


def test_a_new_lora_trains_on_top_of_a_frozen_one_on_the_same_module(tiny, tokens, tmp_path):
    ids, mask = tokens
    with torch.no_grad():
        first = trained_lora(tiny, 0)
        first.save(tmp_path / "a.safetensors", {})
        first.remove()
        second = trained_lora(tiny, 1)
        second.save(tmp_path / "b.safetensors", {})
        second.remove()
        # Both as frozen hooks (loading the chain) ...
        with Chain([FrozenLoRA.load(tmp_path / "a.safetensors"), FrozenLoRA.load(tmp_path / "b.safetensors")]).attached(
            tiny
        ):
            want = full_hidden(tiny, ids, mask)
        # ... equal the first frozen and the second live in PEFT (training the second on top of the first).
        with FrozenLoRA.load(tmp_path / "a.safetensors").attached(tiny):
            live = WeightLoRA.load(tmp_path / "b.safetensors", tiny)
            got = full_hidden(tiny, ids, mask)
            live.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert no_hooks(tiny)


def test_mixed_chain_loads_verified_and_detaches(tiny, tokens, tmp_path):
    ids, mask = tokens
    atlas = saved_atlas(tmp_path)
    residual = trained_residual(tiny, 3, variant="atlas", atlas=atlas)
    save_adapter(tmp_path / "r.safetensors", residual)
    lora = trained_lora(tiny, 0)
    lora.save(tmp_path / "l.safetensors", {})
    lora.remove()
    atlases = {atlas.sha256: atlas}
    chain = Chain(
        [load_delta(tmp_path / "l.safetensors", atlases.get), load_delta(tmp_path / "r.safetensors", atlases.get)]
    )
    assert chain.lowest_layer == 1
    with torch.no_grad():
        before = full_hidden(tiny, ids, mask)
        with chain.attached(tiny):
            moved = full_hidden(tiny, ids, mask)
        assert (moved - before).abs().max() > 1e-3
        torch.testing.assert_close(full_hidden(tiny, ids, mask), before, rtol=0, atol=0)
    assert no_hooks(tiny) and not hasattr(decoder_layers(tiny)[2], "_atlas_residual_stack")


@pytest.mark.parametrize("name", ["r", "l"])
def test_a_flipped_byte_in_any_delta_is_refused(tiny, tmp_path, name):
    atlas = saved_atlas(tmp_path)
    save_adapter(tmp_path / "r.safetensors", trained_residual(tiny, 3, variant="atlas", atlas=atlas))
    lora = trained_lora(tiny, 0)
    lora.save(tmp_path / "l.safetensors", {})
    lora.remove()
    path = tmp_path / f"{name}.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        load_delta(path, {atlas.sha256: atlas}.get)


def test_a_residual_needs_the_atlas_it_was_trained_with(tiny, tmp_path):
    atlas = saved_atlas(tmp_path)
    save_adapter(tmp_path / "r.safetensors", trained_residual(tiny, 3, variant="atlas", atlas=atlas))
    other = atlas_for("local", layer=2, seed=5)
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(IntegrityError, match="atlas sha256"):
        load_delta(tmp_path / "r.safetensors", lambda sha: other)
