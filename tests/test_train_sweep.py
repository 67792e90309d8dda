"""The learning-rate sweep picks the rate with the lowest validation loss and shares the prefix cache."""

import json

import pytest
import torch

from atlas_core.residual import ResidualConfig, build_residual
from atlas_core.train import TrainConfig, WeightLoRA, prefix_cache, prepare_data, sweep_learning_rate
from tests.conftest import tiny_model
from tests.train_fixtures import CharTokenizer, toy_pairs


def test_sweep_picks_lowest_validation_loss_and_builds_caches_once(tmp_path, monkeypatch):
    model = tiny_model("llama")
    pairs = toy_pairs(40)
    config = TrainConfig(epochs=2, batch_size=8, progress=False)
    data = prepare_data(CharTokenizer(), pairs[:32], config, val=pairs[32:], chat=False)
    built = []
    original = prefix_cache.PrefixCache.build.__func__
    monkeypatch.setattr(
        prefix_cache.PrefixCache, "build", classmethod(lambda cls, *a, **k: built.append(1) or original(cls, *a, **k))
    )
    result = sweep_learning_rate(
        model,
        lambda: build_residual(ResidualConfig(variant="plain", layer=2, rank=4), model),
        data,
        config,
        [1e-5, 3e-2],
        tmp_path,
    )
    assert result.best_lr == 3e-2 and result.val_loss[3e-2] < result.val_loss[1e-5]
    assert len(built) == 2  # train and val sets, once for both rates
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["best_lr"] == 3e-2 and (tmp_path / "lr-0.03" / "checkpoints").is_dir()


def test_diverging_rate_loses(tmp_path):
    model = tiny_model("llama")
    pairs = toy_pairs(40)
    config = TrainConfig(epochs=1, batch_size=8, progress=False)
    data = prepare_data(CharTokenizer(), pairs[:32], config, val=pairs[32:], chat=False)
    made = []

    def fresh():  # Weight-LoRA lives inside the model: take the previous rate's out first
        if made:
            made[-1].remove()
        made.append(WeightLoRA(model, layer=2, rank=4))
        if len(made) == 1:  # the first rate's run produces a NaN loss
            with torch.no_grad():
                made[-1].lora_B.fill_(float("nan"))
        return made[-1]

    result = sweep_learning_rate(model, fresh, data, config, [1e-2, 3e-2], tmp_path)
    assert result.val_loss[1e-2] == float("inf") and result.best_lr == 3e-2
    with pytest.raises(ValueError, match="needs validation examples"):
        sweep_learning_rate(
            model, fresh, prepare_data(CharTokenizer(), pairs, config, chat=False), config, [1e-2], tmp_path
        )


def _fake_runs(monkeypatch, losses: dict[float, tuple[float, float | None]]):
    """The sweep's training runs replaced by summaries with these (CE, own-objective) validation losses."""
    from atlas_core.train import sweep
    from atlas_core.train.summary import TrainSummary

    def fake_train(model, adapter, data, config, run_dir, caches=None):
        ce, own = losses[config.lr]
        return TrainSummary(str(run_dir), 1, 1, 1, 1.0, ce, ce, ce, None, [], None, best_val_objective=own)

    monkeypatch.setattr(sweep, "train", fake_train)


def test_sweep_selects_by_the_objective_s_own_validation_loss_and_records_both(tmp_path, monkeypatch):
    model = tiny_model("llama")
    pairs = toy_pairs(12)
    config = TrainConfig(epochs=1, batch_size=8, progress=False, prefix_cache=False)
    data = prepare_data(CharTokenizer(), pairs[:8], config, val=pairs[8:], chat=False)
    make = lambda: build_residual(ResidualConfig(variant="plain", layer=2, rank=4), model)
    _fake_runs(monkeypatch, {1e-3: (1.0, 0.5), 1e-2: (0.9, 0.7)})  # CE prefers 1e-2, the own loss 1e-3
    by_ce = sweep_learning_rate(model, make, data, config, [1e-3, 1e-2], tmp_path / "ce")
    by_own = sweep_learning_rate(model, make, data, config, [1e-3, 1e-2], tmp_path / "own", select="objective")
    assert by_ce.best_lr == 1e-2 and by_own.best_lr == 1e-3
    saved = json.loads((tmp_path / "own" / "sweep.json").read_text())
    assert saved["chosen"] == {"ce": 1e-2, "objective": 1e-3} and saved["select"] == "objective"
    assert saved["val_objective"] == {"0.001": 0.5, "0.01": 0.7}
    # A CE objective has no own loss: both criteria are CE and the record stays as before.
    _fake_runs(monkeypatch, {1e-3: (1.0, None), 1e-2: (0.9, None)})
    plain = sweep_learning_rate(model, make, data, config, [1e-3, 1e-2], tmp_path / "plain", select="objective")
    assert plain.best_lr == 1e-2 and "chosen" not in json.loads((tmp_path / "plain" / "sweep.json").read_text())
    # Runs from before the own loss was recorded, next to new ones, cannot be compared by it.
    _fake_runs(monkeypatch, {1e-3: (1.0, None), 1e-2: (0.9, 0.7)})
    with pytest.raises(ValueError, match=r"rates \[0.001\] have no own-objective validation loss"):
        sweep_learning_rate(model, make, data, config, [1e-3, 1e-2], tmp_path / "mixed", select="objective")
    with pytest.raises(ValueError, match="select: expected one of"):
        sweep_learning_rate(model, make, data, config, [1e-3], tmp_path / "x", select="val")
