"""TALR: w_t proportional to exp(-l_t / tau), tau = the batch median of per-sequence mean response
NLL, normalised to sum to the token count; stop-gradient through the weights."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from atlas_core.train import ObjectiveConfig, TrainConfig, WeightLoRA, collate, prepare_data, train
from atlas_core.train.baselines.talr import talr_sum, talr_weights
from tests.baseline_fixtures import tiny
from tests.train_fixtures import CharTokenizer, toy_pairs


def test_weights_follow_the_formula_on_a_hand_made_batch():
    nll = torch.tensor([0.5, 1.5, 1.0, 3.0, 2.0, 0.2, 0.4])
    rows = torch.tensor([0, 0, 1, 1, 1, 3, 3])  # row 2 has no response tokens
    means = [(0.5 + 1.5) / 2, (1.0 + 3.0 + 2.0) / 3, (0.2 + 0.4) / 2]  # 1.0, 2.0, 0.3
    tau = 1.0  # the median of the three means
    raw = [math.exp(-x / tau) for x in nll.tolist()]
    want = torch.tensor([r * len(raw) / sum(raw) for r in raw])
    got = talr_weights(nll, rows)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert abs(float(got.sum()) - 7) < 1e-5
    assert got[3] < got[2] < got[0]  # harder tokens weigh less
    assert sorted(means)[1] == tau


def test_even_batch_median_is_the_mean_of_the_middle_two():
    nll = torch.tensor([1.0, 2.0, 4.0, 8.0])
    rows = torch.tensor([0, 1, 2, 3])
    raw = torch.exp(-nll / 3.0)  # median of (1, 2, 4, 8) = 3
    torch.testing.assert_close(talr_weights(nll, rows), raw * 4 / raw.sum())


def test_weights_are_constants_for_the_gradient_and_shapes_are_checked():
    model = tiny()
    lora = WeightLoRA(model, layer=1, rank=4)
    with torch.no_grad():
        lora.lora_B.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    config = TrainConfig(progress=False)
    data = prepare_data(CharTokenizer(), toy_pairs(4), config)
    batch = collate(data.train, [0, 1, 2, 3], data.pad_id)
    talr_sum(model, lora, batch, None).backward()
    got = lora.lora_B.grad.clone()
    lora.lora_B.grad = None
    logits = model(input_ids=batch.ids, attention_mask=batch.mask).logits.float()
    sel = batch.targets != -100
    nll = F.cross_entropy(logits[sel], batch.targets[sel], reduction="none")
    w = talr_weights(nll.detach(), sel.nonzero()[:, 0])
    (w * nll).sum().backward()
    torch.testing.assert_close(got, lora.lora_B.grad, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="talr"):
        talr_weights(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    lora.remove()


def test_trainer_uses_the_weighted_loss(tmp_path):
    model = tiny()
    lora = WeightLoRA(model, layer=1, rank=4)  # B = 0: the model is f0 at step 1
    config = TrainConfig(lr=1e-9, epochs=1, batch_size=8, progress=False, objective=ObjectiveConfig(kind="talr"))
    data = prepare_data(CharTokenizer(), toy_pairs(8), config)
    batch = collate(data.train, list(range(8)), data.pad_id)
    with torch.no_grad():
        want = float(talr_sum(model, lora, batch, None)) / batch.num_targets
        plain = float(F.cross_entropy(*_selected(model, batch)))
    summary = train(model, lora, data, config, tmp_path)
    first = json.loads(open(summary.checkpoints[-1] + "/state.json").read())["train_losses"][0]
    assert abs(first - want) < 1e-4 and abs(first - plain) > 1e-3
    lora.remove()


def _selected(model, batch):
    logits = model(input_ids=batch.ids, attention_mask=batch.mask).logits.float()
    sel = batch.targets != -100
    return logits[sel], batch.targets[sel]


def test_own_validation_loss_is_the_weighted_sum_over_validation_batches(tmp_path):
    """TALR's own validation loss: sum_t w_t l_t / N over the validation set in the CE validation
    loss's batches (longest first, `cache_batch_size` a batch); a CE run records none."""
    model = tiny()
    config = TrainConfig(
        lr=1e-9, epochs=1, batch_size=8, cache_batch_size=4, progress=False, objective=ObjectiveConfig(kind="talr")
    )
    pairs = toy_pairs(18)
    data = prepare_data(CharTokenizer(), pairs[:8], config, val=pairs[8:])
    lora = WeightLoRA(model, layer=1, rank=4)
    order = torch.sort(data.val.lengths, descending=True, stable=True).indices.tolist()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(order), 4):
            batch = collate(data.val, order[start : start + 4], data.pad_id)
            logits, targets = _selected(model, batch)
            nll = F.cross_entropy(logits, targets, reduction="none")
            total += float((talr_weights(nll, (batch.targets != -100).nonzero()[:, 0]) * nll).sum())
            count += len(nll)
    summary = train(model, lora, data, config, tmp_path / "talr")
    state = json.loads(open(summary.checkpoints[-1] + "/state.json").read())
    (own,) = state["val_objective"].values()
    (ce,) = state["val_losses"].values()
    assert abs(own - total / count) < 1e-4 and abs(own - ce) > 1e-3
    plain = train(model, lora, data, TrainConfig(lr=1e-9, epochs=1, batch_size=8, progress=False), tmp_path / "ce")
    assert "val_objective" not in json.loads(open(plain.checkpoints[-1] + "/state.json").read())
    assert plain.best_val_objective is None
    lora.remove()
