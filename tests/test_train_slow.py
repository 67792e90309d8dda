"""Training on the real default backbone (SmolLM2-135M): the prefix cache is exact there too, and a
short ATLAS run at the middle layer checkpoints with validation loss. The full 120-problem run
is `bench/train_real_run.py` (output recorded in docs/TRAINING.md)."""

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backbone():
    from atlas_core.backbone import load_backbone

    return load_backbone("smollm2-135m")


def test_short_atlas_run_on_default_backbone(backbone, tmp_path):
    from atlas_core.atlas import AtlasConfig, fit_atlas
    from atlas_core.extract import sample_activations
    from atlas_core.residual import ResidualConfig, attach, build_residual
    from atlas_core.train import TrainConfig, build_caches, prepare_data, train
    from atlas_core.train.adapters import ResidualAdapter
    from atlas_core.train.data import collate
    from atlas_core.train.objectives import selected_logits
    from bench.train_common import gsm8k_texts, mbpp_pairs

    model, layer = backbone.model, backbone.middle_layer
    assert layer == 15
    x = sample_activations(model, backbone.tokenizer, gsm8k_texts(128), layer, 256, progress=False)
    atlas = fit_atlas(x, AtlasConfig(num_charts=8, num_vectors=256), meta={"layer": layer})
    residual = build_residual(ResidualConfig(variant="atlas", layer=layer, rank=16), model, atlas)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = TrainConfig(lr=1e-3, epochs=1, batch_size=4, checkpoint_every_steps=2, progress=False)
    data = prepare_data(backbone.tokenizer, mbpp_pairs("train")[:12], config, val=mbpp_pairs("validation")[:6])

    # the cached path equals the model's own forward with the residual attached
    torch.nn.init.normal_(residual.B, std=0.05)
    batch = collate(data.train, [0, 1, 2], data.pad_id)
    cached, _ = selected_logits(model, ResidualAdapter(residual), batch, build_caches(model, data, layer)["train"])
    with attach(model, residual):
        full = model(input_ids=batch.ids, attention_mask=batch.mask).logits[batch.targets != -100]
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    torch.nn.init.zeros_(residual.B)

    summary = train(model, residual, data, config, tmp_path)
    assert summary.steps == 3 and len(summary.checkpoints) == 2
    state = json.loads((Path(summary.checkpoints[-1]) / "state.json").read_text())
    assert set(state["val_losses"]) == {"2", "3"} and all(0 < v < 10 for v in state["val_losses"].values())
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
