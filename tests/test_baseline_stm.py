"""STM: exactly the response tokens whose f0 NLL exceeds ln 2.5 leave the loss, the mask is
computed once per training set and cached by its hash, and the trainer's loss is CE over the rest."""

import json
import math
from pathlib import Path

import pytest
import torch

from atlas_core.io import IntegrityError
from atlas_core.train import ObjectiveConfig, TrainConfig, WeightLoRA, collate, prepare_data, train
from atlas_core.train.baselines import stm
from tests.baseline_fixtures import flip_byte, tiny
from tests.train_fixtures import CharTokenizer, toy_pairs


def peaky_model():
    """A tiny model with a sharp head, so f0's token NLLs spread on both sides of ln 2.5."""
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(25)
    return model


def hand_nll(model, data):
    """f0's NLL of each response token: one unpadded example at a time, the whole vocabulary."""
    out = []
    with torch.no_grad():
        for ids, p in zip(data.ids, data.prompt_len.tolist()):
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)  # (T, V)
            first = max(p, 1)
            out.append(-logp[first - 1 : len(ids) - 1].gather(1, ids[first:, None])[:, 0])
    return out


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_STATE_DIR", str(tmp_path / "state"))
    model = peaky_model()
    config = TrainConfig(lr=1e-9, epochs=1, batch_size=8, progress=False, objective=ObjectiveConfig(kind="stm"))
    data = prepare_data(CharTokenizer(), toy_pairs(8), config)
    return model, config, data


def test_mask_is_exactly_f0_nll_above_ln_2_5(setup):
    model, config, data = setup
    lora = WeightLoRA(model, layer=1, rank=4)
    drop, info = stm.stm_mask(model, lora, data.train, None, data.pad_id, tau=2.5)
    want = [nll > math.log(2.5) for nll in hand_nll(lora.model, data.train)]
    assert [d.tolist() for d in drop] == [w.tolist() for w in want]
    kept, total = sum(int((~d).sum()) for d in drop), sum(len(d) for d in drop)
    assert 0 < kept < total and info["dropped"] == total - kept  # both sides of the threshold occur
    assert ObjectiveConfig(kind="stm").stm_tau == 2.5
    lora.remove()


def test_f0_nll_is_exact_and_the_threshold_is_sharp(setup):
    """f0's NLLs equal the unpadded hand computation; at a tau between any two neighbouring token
    perplexities the mask splits them exactly there (a shifted threshold, e.g. 1.1 ln tau, fails)."""
    model, config, data = setup
    lora = WeightLoRA(model, layer=1, rank=4)
    hand = hand_nll(lora.model, data.train)
    got = stm.f0_token_nll(model, lora, data.train, None, data.pad_id, batch_size=3)  # padded batches
    for g, h in zip(got, hand):
        torch.testing.assert_close(g, h, rtol=0, atol=1e-4)
    values = torch.cat(hand).sort().values
    for lo, hi in zip(values[:-1].tolist(), values[1:].tolist()):
        if hi - lo > 1e-3:
            tau = math.exp((lo + hi) / 2)
            drop = torch.cat(stm.stm_drop(hand, tau))
            assert int(drop.sum()) == int((values > (lo + hi) / 2).sum())
    lora.remove()


def test_mask_is_cached_by_the_training_set_hash(setup, monkeypatch):
    model, config, data = setup
    lora = WeightLoRA(model, layer=1, rank=4)
    first, info = stm.stm_mask(model, lora, data.train, None, data.pad_id)
    with monkeypatch.context() as m:
        m.setattr(stm, "f0_token_nll", lambda *a, **k: pytest.fail("recomputed a cached mask"))
        again, info2 = stm.stm_mask(model, lora, data.train, None, data.pad_id)
    assert info2["key"] == info["key"] and all(torch.equal(a, b) for a, b in zip(first, again))
    other = prepare_data(CharTokenizer(), toy_pairs(8, seed=3), config)  # another training set: another key
    _, info3 = stm.stm_mask(model, lora, other.train, None, other.pad_id)
    assert info3["key"] != info["key"]
    flip_byte(Path(info["path"]))
    with pytest.raises(IntegrityError, match="sha256"):
        stm.stm_mask(model, lora, data.train, None, data.pad_id)
    lora.remove()


def test_trainer_loss_is_ce_over_the_kept_tokens(setup, tmp_path):
    model, config, data = setup
    lora = WeightLoRA(model, layer=1, rank=4)  # B = 0: the model is f0 at step 1
    nll = hand_nll(model, data.train)
    kept = torch.cat([x[x <= math.log(2.5)] for x in nll])
    summary = train(model, lora, data, config, tmp_path / "run")  # one step: all 8 examples in one batch
    first = json.loads(open(summary.checkpoints[-1] + "/state.json").read())["train_losses"][0]
    assert abs(first - float(kept.mean())) < 1e-4
    assert summary.stm["dropped"] == sum(len(x) for x in nll) - len(kept)
    assert "STM:" in summary.format()
    lora.remove()


def test_apply_drop_refuses_a_mask_of_another_shape(setup):
    _, _, data = setup
    b = collate(data.train, [0, 1], data.pad_id)
    with pytest.raises(ValueError, match="stm"):
        stm.apply_drop(b, [torch.zeros(1, dtype=torch.bool)] * len(data.train))


def test_own_validation_loss_is_ce_over_the_kept_validation_tokens(tmp_path, monkeypatch):
    """STM's own validation loss drops the validation tokens f0 finds hard (the rule of its training
    set); the CE validation loss keeps them all. At lr ~ 0 the model is f0 at every checkpoint."""
    monkeypatch.setenv("ATLAS_STATE_DIR", str(tmp_path / "state"))
    model = peaky_model()
    config = TrainConfig(lr=1e-9, epochs=1, batch_size=8, progress=False, objective=ObjectiveConfig(kind="stm"))
    pairs = toy_pairs(8)
    data = prepare_data(CharTokenizer(), pairs, config, val=pairs[2:7])  # seen in training: f0's mask all the same
    lora = WeightLoRA(model, layer=1, rank=4)
    nll = hand_nll(model, data.val)
    kept = torch.cat([x[x <= math.log(2.5)] for x in nll])
    assert 0 < len(kept) < sum(len(x) for x in nll)  # the rule drops some validation tokens, not all
    summary = train(model, lora, data, config, tmp_path / "run")
    state = json.loads(open(summary.checkpoints[-1] + "/state.json").read())
    (own,) = state["val_objective"].values()
    (ce,) = state["val_losses"].values()
    assert abs(own - float(kept.mean())) < 1e-4
    assert abs(ce - float(torch.cat(nll).mean())) < 1e-4 and abs(own - ce) > 1e-2
    assert summary.best_val_objective == own and "own objective" in summary.format()
    lora.remove()


def test_no_own_validation_loss_when_the_rule_drops_every_validation_token(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_STATE_DIR", str(tmp_path / "state"))
    model = tiny()  # a random f0 finds every response token hard (NLL > ln 2.5): STM drops them all
    config = TrainConfig(lr=1e-9, epochs=1, batch_size=8, progress=False, objective=ObjectiveConfig(kind="stm"))
    pairs = toy_pairs(8)
    lora = WeightLoRA(model, layer=1, rank=4)
    data = prepare_data(CharTokenizer(), pairs, config, val=pairs[2:7])
    summary = train(model, lora, data, config, tmp_path / "all-dropped")
    assert "val_objective" not in json.loads(open(summary.checkpoints[-1] + "/state.json").read())
    assert summary.best_val_objective is None and summary.best_val_loss is not None
    lora.remove()
