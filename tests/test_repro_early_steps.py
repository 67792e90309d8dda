"""bench/repro/early_steps.py: a method's first epoch at a finer grain, scored as the runner scores."""

from __future__ import annotations

import pytest

from bench.repro.config import repro_from_dict
from bench.repro.early_steps import early_steps
from bench.repro.runner import Budget, Runner
from tests.test_repro_runner import CONFIG, TinyWorld


def test_every_step_is_scored_and_the_epoch_end_reproduces_the_stored_unit(tmp_path):
    config = repro_from_dict({**CONFIG, "methods": {"atlas": CONFIG["methods"]["atlas"]}, "seeds": [0]})
    assert Runner(config, tmp_path / "results", tmp_path / "state", TinyWorld(), Budget(None)).run()
    runner = Runner(config, tmp_path / "results", tmp_path / "state", TinyWorld(), Budget(None))
    rows, stored = early_steps(runner, "atlas", every=1)
    assert [step for step, _, _ in rows] == [1, 2]  # 16 pairs in batches of 8: two steps an epoch
    # One Adam step from B = 0 barely moves the outputs: step 1's fp32 KL sits at the noise floor
    # (on an AVX-512 machine it read -9e-9); by the epoch's end it is clearly above it.
    assert abs(rows[0][2]) < rows[1][2] and rows[1][2] > 1e-8
    # the retrain is the stored run's first epoch: the same NLL and KL, bit for bit
    assert stored["step"] == 2 and rows[-1][1:] == (stored["heldout_nll"], stored["kl"]["mean"])
    with pytest.raises(ValueError, match="every"):
        early_steps(runner, "atlas", every=0)
    with pytest.raises(ValueError, match="no learning rate"):
        early_steps(runner, "plain", every=1)
