"""Every baseline's file in configs/train/ loads and builds its method (the hub's files are what
policies and the reproduction runner name)."""

from dataclasses import replace
from pathlib import Path

import pytest

from atlas_core.train import LoRAOptions, RunConfig, build_adapter, load_run_config
from atlas_core.typed_config import ConfigError
from tests.baseline_fixtures import LAYER, stats_for, tiny

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "train"
EXPECTED = {  # file -> (lora.method, objective, what the file fixes)
    "lora-null": ("lora-null", "ce", {"mode": "v1"}),
    "lora-null-v2": ("lora-null", "ce", {"mode": "v2"}),
    "oplora-k16": ("oplora", "ce", {"k": 16}),
    "oplora-k128": ("oplora", "ce", {"k": 128}),
    "o-lora": ("o-lora", "ce", {"lam": 0.5}),
    "corda-kpm": ("corda-kpm", "ce", {}),
    "clora": ("clora", "ce", {"lam": 1.0}),
    "toplora": ("toplora", "ce", {}),
    "centered-lora": ("centered-lora", "ce", {}),
    "o-lora-centered": ("o-lora", "ce", {"lam": 0.5, "past": "pca-centered"}),
    "stm": ("weight-lora", "stm", {}),
    "talr": ("weight-lora", "talr", {}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_and_builds_its_method(name):
    rc = load_run_config(CONFIGS / f"{name}.yaml")
    method, objective, fixed = EXPECTED[name]
    assert (rc.adapter, rc.lora.method, rc.train.objective.kind, rc.rank, rc.layer) == (
        "weight-lora",
        method,
        objective,
        16,
        15,
    )
    small = replace(rc, layer=LAYER, rank=4)
    if name == "oplora-k128":  # k = 128 needs d >= 128: the d = 64 model refuses it by name
        with pytest.raises(ValueError, match="oplora.k"):
            build_adapter(small, tiny())
    model = tiny(hidden=160) if name == "oplora-k128" else tiny()
    adapter = build_adapter(small, model, stats=stats_for(model))
    assert adapter.method == method
    for key, value in fixed.items():
        assert getattr(adapter, key) == value
    adapter.remove()


def test_a_baseline_method_on_a_residual_adapter_is_refused():
    with pytest.raises(ConfigError, match="lora.method"):
        RunConfig(adapter="plain", lora=LoRAOptions(method="oplora"))


def test_plain_weight_lora_keeps_its_run_key_fields():
    """Fields added for the baselines do not enter Weight-LoRA's or the other objectives' dicts, so the
    content keys of runs recorded before them (ledger, resume) are unchanged."""
    rc = load_run_config(CONFIGS / "weight-lora.yaml")
    d = rc.to_dict()
    assert d["lora"] == {"alpha": 16.0, "target": "self_attn.o_proj"}
    assert "stm_tau" not in d["train"]["objective"]
    assert "stm_tau" in load_run_config(CONFIGS / "stm.yaml").to_dict()["train"]["objective"]
