"""Retained statistics: C = X^T X of layer l's o_proj inputs (padding excluded), the per-sequence
scaled forms, and content-addressed storage: once per (backbone, layer, retained data)."""

import pytest
import torch

from atlas_core.backbone import decoder_layers
from atlas_core.io import IntegrityError
from atlas_core.train.retained_stats import RetainedStats, collect_stats, retained_stats
from tests.baseline_fixtures import LAYER, flip_byte, retained_ids, tiny


def inputs_one_by_one(model, seqs):
    seen = []
    h = decoder_layers(model)[LAYER].self_attn.o_proj.register_forward_pre_hook(
        lambda m, a: seen.append(a[0][0].double())
    )
    with torch.no_grad():
        for s in seqs:
            model(input_ids=s[None])
    h.remove()
    return seen


def test_matrices_equal_a_hand_computation_on_unpadded_sequences():
    model = tiny()
    seqs = retained_ids(5)  # different lengths: the batched pass pads, the hand pass does not
    xs = inputs_one_by_one(model, seqs)
    stats = collect_stats(model, LAYER, seqs, batch_size=4)
    X = torch.cat(xs)
    torch.testing.assert_close(stats.cov, X.T @ X, rtol=1e-5, atol=1e-6)  # fp32 forwards, padded vs not
    cov_max = sum((x / x.abs().max()).T @ (x / x.abs().max()) for x in xs)
    torch.testing.assert_close(stats.cov_max, cov_max, rtol=1e-5, atol=1e-6)  # fp32 forwards, padded vs not
    cov_corda = sum((x / x.max().abs()).T @ (x / x.max().abs()) for x in xs) / len(xs)  # PEFT's hook
    torch.testing.assert_close(stats.cov_corda, cov_corda, rtol=1e-5, atol=1e-6)  # fp32 forwards, padded vs not
    assert stats.tokens == len(X) and stats.sequences == 5
    torch.testing.assert_close(stats.mean, X.mean(0), rtol=1e-5, atol=1e-6)  # padding excluded
    Xc = X - X.mean(0)
    torch.testing.assert_close(
        stats.matrix("cov_centered", LAYER, stats.target, X.shape[1]), Xc.T @ Xc, rtol=1e-5, atol=1e-5
    )


def test_stored_once_per_backbone_layer_and_data(tmp_path, monkeypatch):
    model = tiny()
    seqs = retained_ids(4)
    first = retained_stats(model, LAYER, seqs, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1 and first.key and first.sha256
    import atlas_core.train.retained_stats as rs

    with monkeypatch.context() as m:
        m.setattr(rs, "collect_stats", lambda *a, **k: pytest.fail("recomputed stored statistics"))
        again = retained_stats(model, LAYER, seqs, cache_dir=tmp_path)
    assert again.key == first.key and torch.equal(again.cov, first.cov)
    keys = {
        first.key,
        retained_stats(model, LAYER, retained_ids(3), cache_dir=tmp_path).key,  # other data
        retained_stats(model, 0, seqs, cache_dir=tmp_path).key,  # another layer
        retained_stats(tiny(seed=1), LAYER, seqs, cache_dir=tmp_path).key,
    }  # another backbone (the probe)
    assert len(keys) == 4 and len(list(tmp_path.glob("*.safetensors"))) == 4


def test_a_flipped_byte_is_refused(tmp_path):
    stats = retained_stats(tiny(), LAYER, retained_ids(3), cache_dir=tmp_path)
    path = tmp_path / f"{stats.key}.safetensors"
    RetainedStats.load(path)
    flip_byte(path)
    with pytest.raises(IntegrityError, match="sha256"):
        RetainedStats.load(path)
