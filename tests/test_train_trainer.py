"""The trainer on tiny models: learning, frozen backbone, cached == uncached, LoRA, objectives, guards."""

import json

import pytest
import torch

from atlas_core.io import load_verified
from atlas_core.residual import ResidualConfig, attach, build_residual
from atlas_core.train import (
    ObjectiveConfig,
    TrainConfig,
    TrainingDiverged,
    WeightLoRA,
    build_caches,
    latest_checkpoint,
    prepare_data,
    train,
)
from atlas_core.train.data import collate
from atlas_core.train.objectives import selected_logits
from tests.conftest import tiny_model
from tests.train_fixtures import CharTokenizer, retained_texts, tiny_atlas, toy_pairs

PAIRS = toy_pairs(40)


def make(config: TrainConfig, retained=None):
    return prepare_data(CharTokenizer(), PAIRS[:32], config, val=PAIRS[32:], retained=retained, chat=False)


def losses(summary) -> list[float]:
    return json.loads((__import__("pathlib").Path(summary.checkpoints[-1]) / "state.json").read_text())["train_losses"]


def test_loss_decreases_only_factors_change_backbone_bit_identical(tmp_path):
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    residual = build_residual(ResidualConfig(variant="plain", layer=2, rank=4), model)
    a0, b0 = residual.A.detach().clone(), residual.B.detach().clone()
    config = TrainConfig(lr=3e-2, epochs=4, batch_size=8, progress=False)
    summary = train(model, residual, make(config), config, tmp_path)
    curve = losses(summary)
    assert sum(curve[-4:]) / 4 < curve[0] - 0.2
    assert summary.best_val_loss < 4.4  # the random model starts at ~ln(97) = 4.57
    assert not torch.equal(residual.A, a0) and not torch.equal(residual.B, b0)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cached_forward_equals_attached_full_forward(family):
    model = tiny_model(family)
    pairs = [p + r for p, r in PAIRS]
    atlas = tiny_atlas(model, 1, pairs)
    residual = build_residual(ResidualConfig(variant="atlas", layer=1, rank=4, scale="calibrated"), model, atlas)
    torch.nn.init.normal_(residual.B, std=0.3)
    config = TrainConfig(progress=False)
    data = make(config)
    caches = build_caches(model, data, layer=1, batch_size=5)  # other batch shapes than the batches below
    batch = collate(data.train, [3, 7, 1, 12], data.pad_id)
    from atlas_core.train.adapters import ResidualAdapter

    adapter = ResidualAdapter(residual)
    cached, targets = selected_logits(model, adapter, batch, caches["train"])
    uncached, targets2 = selected_logits(model, adapter, batch, None)
    with attach(model, residual):  # the reference: the model's own forward, logits gathered afterwards
        full = model(input_ids=batch.ids, attention_mask=batch.mask).logits[batch.targets != -100]
    assert torch.equal(targets, targets2)
    torch.testing.assert_close(uncached, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adapter_kind", ["atlas", "weight-lora"])
def test_cached_and_uncached_training_agree(tmp_path, adapter_kind):
    """Same loss curve (|diff| < 1e-4 nats per step) and the same weights (atol 1e-5) after 8 steps."""
    results = []
    for cached in (True, False):
        model = tiny_model("llama")
        if adapter_kind == "atlas":
            atlas = tiny_atlas(model, 2, [p + r for p, r in PAIRS])
            adapter = build_residual(ResidualConfig(variant="atlas", layer=2, rank=4, scale="calibrated"), model, atlas)
            weights = lambda: [adapter.A, adapter.B]
        else:
            adapter = WeightLoRA(model, layer=2, rank=4)
            weights = lambda: [adapter.lora_A, adapter.lora_B]
        config = TrainConfig(lr=3e-2, epochs=2, batch_size=8, prefix_cache=cached, progress=False)
        summary = train(model, adapter, make(config), config, tmp_path / str(cached))
        assert summary.prefix_cache_layer == ((2 if adapter_kind == "atlas" else 1) if cached else None)
        results.append((losses(summary), [w.detach().clone() for w in weights()]))
    (curve_c, w_c), (curve_u, w_u) = results
    assert len(curve_c) == 8
    assert max(abs(a - b) for a, b in zip(curve_c, curve_u)) < 1e-4
    for a, b in zip(w_c, w_u):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_weight_lora_budget_and_removal(tmp_path):
    model = tiny_model("qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, 97, (2, 9))
    base = model(input_ids=ids).logits
    lora = WeightLoRA(model, layer=2, rank=8)
    o_proj = lora.base
    assert lora.num_trainable == 8 * (o_proj.in_features + o_proj.out_features) == 2 * 64 * 8
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "model.layers.2.self_attn.o_proj.lora_A.default.weight",
        "model.layers.2.self_attn.o_proj.lora_B.default.weight",
    ]
    config = TrainConfig(lr=3e-2, epochs=1, batch_size=8, progress=False)
    summary = train(model, lora, make(config), config, tmp_path)
    assert not torch.equal(model(input_ids=ids).logits, base)
    path = latest_checkpoint(tmp_path) / "adapter.safetensors"
    tuned = model(input_ids=ids).logits
    lora.remove()
    assert torch.equal(model(input_ids=ids).logits, base)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before) and set(model.state_dict()) == set(before)
    with WeightLoRA.load(path, model):  # a saved Weight-LoRA reproduces the trained model
        assert torch.equal(model(input_ids=ids).logits, tuned)
    assert summary.steps == 4


def test_checkpoint_files_and_validation_losses(tmp_path):
    model = tiny_model("llama")
    residual = build_residual(ResidualConfig(variant="plain", layer=2, rank=4), model)
    config = TrainConfig(lr=1e-2, epochs=2, batch_size=8, checkpoint_every_steps=3, progress=False)
    summary = train(model, residual, make(config), config, tmp_path)
    names = [p.rsplit("/", 1)[1] for p in summary.checkpoints]
    assert names == ["step-000003", "step-000004", "step-000006", "step-000008"]  # 4 steps per epoch
    state = json.loads((tmp_path / "checkpoints" / "step-000006" / "state.json").read_text())
    assert state["step"] == 6 and state["epoch"] == 1 and state["step_in_epoch"] == 2 and not state["epoch_end"]
    assert set(state["val_losses"]) == {"3", "4", "6"} and state["seed"] == 0 and len(state["config_hash"]) == 64
    tensors, manifest = load_verified(tmp_path / "checkpoints" / "step-000006" / "optimizer.safetensors", "optimizer")
    assert {"A.exp_avg", "A.exp_avg_sq", "A.step", "B.exp_avg", "rng.torch"} <= set(tensors)
    assert float(tensors["A.step"]) == 6
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.pkl"))
    assert summary.best_val_loss == min(summary.best_val_loss, summary.final_val_loss)
    assert "training summary" in summary.format() and "best checkpoint" in summary.format()


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    model = tiny_model("llama")
    residual = build_residual(ResidualConfig(variant="plain", layer=2, rank=4), model)
    calls = {"n": 0}

    def poison(_module, _args, output):  # from the 6th forward (step 6, in epoch 1) on, NaN
        calls["n"] += 1
        return output * float("nan") if calls["n"] > 5 else output

    model.model.norm.register_forward_hook(poison)
    config = TrainConfig(
        lr=1e-2, epochs=3, batch_size=8, checkpoint_every_steps=2, validate_every_checkpoint=False, progress=False
    )
    with pytest.raises(TrainingDiverged, match=r"step 6 \(epoch 1\): loss is nan.*Last good checkpoint: .*step-000004"):
        train(model, residual, prepare_data(CharTokenizer(), PAIRS[:32], config, chat=False), config, tmp_path)
    assert latest_checkpoint(tmp_path).name == "step-000004"
    assert json.loads((tmp_path / "failed.json").read_text())["step"] == 6


def test_output_kl_and_replay(tmp_path):
    retained = retained_texts(12)
    runs = {}
    for kind, cache_mib in (("ce", 0), ("output-kl", 512), ("output-kl", 0), ("replay", 0)):
        model = tiny_model("llama")
        residual = build_residual(ResidualConfig(variant="plain", layer=2, rank=4), model)
        config = TrainConfig(
            lr=3e-2,
            epochs=2,
            batch_size=8,
            progress=False,
            objective=ObjectiveConfig(kind=kind, beta=10.0, ratio=1.0, teacher_cache_mib=cache_mib),
        )
        data = make(config, retained=retained)
        summary = train(model, residual, data, config, tmp_path / f"{kind}-{cache_mib}")
        assert summary.teacher_cached == ({512: True, 0: False}[cache_mib] if kind == "output-kl" else None)
        # retained KL(f0 || f) of the result, on every retained context
        batch = collate(data.retained, list(range(len(retained))), data.pad_id, all_positions=True)
        from atlas_core.train.adapters import ResidualAdapter

        adapter = ResidualAdapter(residual)
        with torch.no_grad():
            f, _ = selected_logits(model, adapter, batch, None)
            f0, _ = selected_logits(model, adapter, batch, None, enabled=False)
        kl = torch.nn.functional.kl_div(f.log_softmax(-1), f0.log_softmax(-1), log_target=True, reduction="batchmean")
        runs[(kind, cache_mib)] = (losses(summary), float(kl))
    # the teacher cache changes nothing but speed (teacher log-probs from other batch shapes: 1e-5)
    assert max(abs(a - b) for a, b in zip(runs[("output-kl", 512)][0], runs[("output-kl", 0)][0])) < 1e-5
    assert runs[("output-kl", 0)][0][0] == pytest.approx(runs[("ce", 0)][0][0], abs=1e-6)  # B = 0: KL starts at 0
    assert runs[("output-kl", 0)][1] < 0.5 * runs[("ce", 0)][1]  # the KL term keeps f close to f0
    assert runs[("replay", 0)][0][0] > runs[("ce", 0)][0][0] + 1.0  # + LM loss on retained text


def test_resume_refuses_other_config(tmp_path):
    model = tiny_model("llama")
    residual = build_residual(ResidualConfig(variant="plain", layer=2, rank=4), model)
    config = TrainConfig(lr=1e-2, epochs=1, batch_size=8, progress=False)
    train(model, residual, make(config), config, tmp_path)
    other = TrainConfig(lr=2e-2, epochs=1, batch_size=8, progress=False)
    with pytest.raises(ValueError, match="config hash differs"):
        train(model, residual, make(other), other, tmp_path)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(model, residual, make(config), config, tmp_path, resume=False)


def test_weight_lora_factors_stay_fp32_in_a_bf16_model():
    model = tiny_model("llama").to(torch.bfloat16)
    lora = WeightLoRA(model, layer=2, rank=4)
    assert lora.lora_A.dtype == lora.lora_B.dtype == torch.float32
    assert lora.base.weight.dtype == torch.bfloat16
    with torch.no_grad():
        lora.lora_B.normal_()
    out = model(input_ids=torch.randint(3, 97, (1, 5))).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    lora.remove()
