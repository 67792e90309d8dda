"""The reproduction runner trains and scores the baselines: the ones that need retained statistics
get them from the workload's calibration contexts, computed once and stored by content."""

import json

from bench.repro.config import repro_from_dict
from bench.repro.runner import Budget, Runner
from tests.test_repro_runner import LAYER, TinyWorld

CONFIG = {
    "name": "tiny-baselines",
    "backbone": "tiny",
    "dtype": "float32",
    "layer": LAYER,
    "rank": 4,
    "methods": {
        "lora-null": "configs/train/lora-null.yaml",
        "oplora": "configs/train/oplora-k16.yaml",
        "stm": "configs/train/stm.yaml",
    },
    "reference": "lora-null",
    "seeds": [0],
    "epochs": 1,
    "lr_grid": [1e-2],
    "eval": {
        "mbpp_plus_limit": 4,
        "heldout_limit": 4,
        "kl_contexts": 6,
        "churn_questions": 4,
        "kl_batch_size": 4,
        "nll_levels": 3,
    },
}


class CalibratedWorld(TinyWorld):
    def __call__(self):
        w = super().__call__()
        w.calibration = [f"The answer is {i} plus {i + 1}. #### {2 * i + 1}" for i in range(12)]
        return w


def test_baselines_run_in_the_reproduction(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_STATE_DIR", str(tmp_path / "atlas-state"))  # STM's mask cache
    assert Runner(
        repro_from_dict(CONFIG), tmp_path / "results", tmp_path / "state", CalibratedWorld(), Budget(None)
    ).run()
    for method in CONFIG["methods"]:
        units = list((tmp_path / "results" / "units" / method).glob("seed0-step*.json"))
        kl = json.loads(units[-1].read_text())["kl"]["mean"]
        # a random f0 finds every response token hard (NLL > ln 2.5): STM drops them all and stays put
        assert kl > 0 if method != "stm" else kl == 0
    # one mask per set, computed once for the sweep's rates and the run: training and validation (its own loss)
    assert len(list((tmp_path / "atlas-state" / "stm-masks").glob("*.safetensors"))) == 2
    assert len(list((tmp_path / "state" / "retained-stats").glob("*.safetensors"))) == 1  # once, shared
