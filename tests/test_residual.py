"""The residual operator, its variants, attaching it to tiny Llama/Qwen3 models, adapter files."""

import pytest
import torch

from atlas_core.atlas import AtlasConfig, fit_atlas, route
from atlas_core.backbone import decoder_layers, hidden_at_layer
from atlas_core.io import IntegrityError
from atlas_core.residual import (
    RESIDUAL_VARIANTS,
    AtlasResidual,
    ResidualConfig,
    attach,
    build_residual,
    load_adapter,
    save_adapter,
)
from tests.test_routing_filter import slow_filter_matrix, slow_weights

ATLAS_FOR = {"local": "local", "global": "global", "random-local": "random-local", "shuffled-patch": "shuffled-patch"}


def atlas_for(variant: str, d=64, layer=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, d, generator=g) + 3 * torch.randn(8, d, generator=g).repeat(50, 1)
    return fit_atlas(x, AtlasConfig(num_charts=8, rank=4, variant=variant, num_vectors=400), meta={"layer": layer})


def residual_for(model, variant, layer=2, **kw):
    needed = RESIDUAL_VARIANTS[variant]
    atlas = atlas_for(needed, layer=layer) if needed else None
    return build_residual(ResidualConfig(variant=variant, layer=layer, **kw), model, atlas), atlas


def slow_delta(r, h):
    """Delta(h) token by token with explicit d x d filters (spec section 3)."""
    v, out = r.config.variant, []
    a, b = r.A.detach(), r.B.detach()
    if v == "plain":
        return h @ a.T @ b.T
    bases = r.U.T.reshape(-1, r.m, r.dim).transpose(1, 2)  # (K, d, m)
    w_all = slow_weights(h, r.centers, r.tau, r.config.top_n)
    for x, w in zip(h, w_all):
        e = x - w @ r.centers
        p = slow_filter_matrix(w, bases, r.config.alpha)
        if v == "centered":
            out.append(b @ a @ e)
        elif v == "centered-distance":
            out.append(e.norm() / (e.norm() + r.s_d) * b @ a @ e)
        elif v == "input-filter":
            out.append(b @ a @ p @ e)
        else:
            z = p @ e
            out.append(z.norm() / (z.norm() + r.s) * p @ b @ a @ z)
    return torch.stack(out)


@pytest.mark.parametrize("variant", list(RESIDUAL_VARIANTS))
def test_parameter_count_is_2dr(tiny, variant):
    r, _ = residual_for(tiny, variant, rank=8)
    params = [p for p in r.parameters() if p.requires_grad]
    assert sum(p.numel() for p in params) == 2 * 64 * 8
    assert (r.B == 0).all()


@pytest.mark.parametrize("variant", list(RESIDUAL_VARIANTS))
@pytest.mark.parametrize("scale", [5.0, "calibrated"])
def test_fast_operator_equals_slow_reference(tiny, variant, scale):
    r, atlas = residual_for(tiny, variant, scale=scale, alpha=0.8)
    torch.nn.init.normal_(r.B, std=0.5)
    h = torch.randn(40, 64) * 2 + (atlas.centers[torch.arange(40) % atlas.num_charts] if atlas is not None else 0)
    torch.testing.assert_close(r(h), slow_delta(r, h), atol=2e-4, rtol=2e-4)


def test_bf16_operator_tracks_fp32(tiny):
    r, atlas = residual_for(tiny, "atlas")
    torch.nn.init.normal_(r.B, std=0.5)
    h = torch.randn(64, 64) + atlas.centers[torch.arange(64) % 8]
    ref = r(h)
    low = r(h.bfloat16()).float()
    assert ((low - ref).norm() / ref.norm()) < 0.03


def test_calibrated_scales(tiny):
    r, atlas = residual_for(tiny, "centered-distance", scale="calibrated")
    full, _ = residual_for(tiny, "atlas", scale="calibrated")
    x = atlas.calibration
    w = route(x, full.centers, full.tau, 4)
    e = x - w @ full.centers
    bases = full.U.T.reshape(-1, full.m, full.dim).transpose(1, 2)
    z = torch.stack([(slow_filter_matrix(w[i], bases, 1.0) @ e[i]).norm() for i in range(len(x))])
    assert float(full.s) == pytest.approx(float(z.median()), rel=1e-4)
    e_norm = e.norm(dim=1)
    assert float((e_norm / (e_norm + r.s_d)).mean()) == pytest.approx(float((z / (z + full.s)).mean()), rel=1e-4)


@pytest.mark.parametrize("variant", ["plain", "atlas", "centered-distance"])
def test_zero_b_keeps_logits_exactly(tiny, tokens, variant):
    ids, mask = tokens
    base = tiny(input_ids=ids, attention_mask=mask).logits
    r, _ = residual_for(tiny, variant)
    with attach(tiny, r):
        adapted = tiny(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(adapted, base)


def test_nonzero_b_changes_logits_but_not_lower_layers(tiny, tokens):
    ids, mask = tokens
    base_out = tiny(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hooks_before = [len(layer._forward_hooks) for layer in decoder_layers(tiny)]
    r, _ = residual_for(tiny, "atlas", layer=2)
    torch.nn.init.normal_(r.B, std=0.5)
    with attach(tiny, r):
        out = tiny(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        h2 = hidden_at_layer(tiny, 2, ids, mask)
    for i in range(3):  # embeddings and the outputs of layers 0 and 1
        assert torch.equal(out.hidden_states[i], base_out.hidden_states[i])
    assert not torch.allclose(out.logits, base_out.logits)
    base_h2 = hidden_at_layer(tiny, 2, ids, mask)
    torch.testing.assert_close(h2, base_h2 + r(base_h2))
    torch.testing.assert_close(out.hidden_states[3], h2)  # reported hidden states include the residual
    # detached: back to the base model, nothing left behind
    assert torch.equal(tiny(input_ids=ids, attention_mask=mask).logits, base_out.logits)
    assert [len(layer._forward_hooks) for layer in decoder_layers(tiny)] == hooks_before


def test_generation_with_adapter(tiny, tokens):
    ids, _ = tokens
    r, _ = residual_for(tiny, "atlas")
    torch.nn.init.normal_(r.B, std=2.0)
    base = tiny.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    with attach(tiny, r):
        adapted = tiny.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
        # cached decoding gives what a full forward over the whole sequence gives
        full = tiny(input_ids=adapted[:, :-1]).logits[0, -1].argmax()
    assert int(full) == int(adapted[0, -1])
    assert base.shape == adapted.shape and not torch.equal(base, adapted)  # the adapter changed the tokens
    assert torch.equal(tiny.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), base)  # detached


@pytest.mark.parametrize("variant", ["plain", "atlas", "global-pca", "centered-distance"])
def test_adapter_round_trip_bit_exact(tiny, tmp_path, variant):
    r, atlas = residual_for(tiny, variant, scale="calibrated")
    torch.nn.init.normal_(r.B)
    if atlas is not None:
        atlas.save(tmp_path / "atlas.safetensors")
        r = build_residual(ResidualConfig(variant=variant, layer=2, scale="calibrated"), tiny, atlas)  # knows the sha
        torch.nn.init.normal_(r.B)
    save_adapter(tmp_path / "adapter.safetensors", r, {"step": 3})
    loaded = load_adapter(tmp_path / "adapter.safetensors", atlas)
    for name, t in r.state_dict().items():  # bit-exact; unused scales are NaN on both sides
        torch.testing.assert_close(t, loaded.state_dict()[name], rtol=0, atol=0, equal_nan=True)
    h = torch.randn(7, 64)
    assert torch.equal(r(h), loaded(h))


def test_adapter_flipped_byte_and_wrong_atlas_rejected(tiny, tmp_path):
    r, atlas = residual_for(tiny, "atlas")
    atlas.save(tmp_path / "atlas.safetensors")
    r = build_residual(ResidualConfig(variant="atlas", layer=2), tiny, atlas)
    path = tmp_path / "adapter.safetensors"
    save_adapter(path, r)
    other = atlas_for("local", seed=1)
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(IntegrityError, match="trained with atlas sha256"):
        load_adapter(path, other)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        load_adapter(path, atlas)


def test_wrong_atlas_variant_and_shape_errors(tiny):
    with pytest.raises(ValueError, match="needs an atlas of variant 'global'"):
        build_residual(ResidualConfig(variant="global-pca", layer=2), tiny, atlas_for("local"))
    with pytest.raises(ValueError, match="needs an atlas"):
        build_residual(ResidualConfig(variant="atlas", layer=2), tiny, None)
    r, _ = residual_for(tiny, "plain")
    with pytest.raises(ValueError, match="expected last dimension d=64"):
        r(torch.randn(3, 32))
    with pytest.raises(ValueError, match="layer: expected"):
        build_residual(ResidualConfig(variant="plain", layer=9), tiny)


def test_middle_layer_default(tiny):
    r = build_residual(ResidualConfig(variant="plain"), tiny)
    assert r.config.layer == 2


def test_a_few_tokens_run_on_one_thread_and_the_thread_count_comes_back(tiny, monkeypatch):
    """Decoding (a token a row) runs the operator on one thread: each small op split over OpenMP
    threads that wait passively waits longer for a thread to wake than the op takes. The result is
    the same, and the caller's thread count is restored, also when the operator raises."""
    import atlas_core.residual.layer as layer

    r, _ = residual_for(tiny, "atlas")
    torch.nn.init.normal_(r.B, std=0.1)
    seen, route = [], layer.route_with_offset

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return route(*args, **kwargs)

    monkeypatch.setattr(layer, "route_with_offset", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        h = torch.randn(2, layer.FEW_TOKENS + 1, r.dim)  # (B, T, d)
        with torch.no_grad():
            many = r(h)  # 2 * 65 tokens: every thread
            few = r(h[:, :1])  # 2 tokens: one thread
        assert seen == [2, 1] and torch.get_num_threads() == 2
        torch.testing.assert_close(few, many[:, :1], rtol=0, atol=1e-6)
        monkeypatch.setattr(layer, "route_with_offset", lambda *a, **k: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            r(h[:, :1])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_centered_residual_on_a_single_chart_is_centered_on_the_calibration_mean():
    # The common-mode control (issue 32): one chart's center is the calibration mean, so the
    # centered residual is B A (h - mean(X)), whatever the routing temperature.
    x = torch.randn(200, 32) * 3 + torch.randn(32) * 10  # (N, d) far from the origin
    atlas = fit_atlas(x, AtlasConfig(num_charts=1, rank=4, num_vectors=200), meta={"layer": 1})
    r = AtlasResidual(ResidualConfig(variant="centered", layer=1, rank=8), 32, atlas)
    torch.nn.init.normal_(r.B, generator=torch.Generator().manual_seed(0))
    h = torch.randn(3, 5, 32) * 3  # (B, T, d)
    with torch.no_grad():
        want = (h - x.mean(0)) @ r.A.T @ r.B.T  # (B, T, d)
        assert torch.allclose(r(h), want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(r(h), h @ r.A.T @ r.B.T, atol=1e-2)  # the mean is not zero: it matters
