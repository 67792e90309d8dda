"""End-to-end: one update cycle on the real default backbone (SmolLM2-135M) with the CI subset
(configs/update/ci.yaml: 4 MBPP+ problems scored by EvalPlus, 8 GSM8K / 8 CSQA questions,
16 KL contexts, one short epoch per method). Slow, but run in CI: a few minutes on 2 cores."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.flows_fixtures import ledger_counts, prefect_harness, state  # noqa: F401

pytestmark = pytest.mark.slow


def test_update_cycle_on_the_default_backbone(prefect_harness, state, tmp_path):
    from flows.platform import open_platform
    from flows.update import update
    from registry import get_model, latest_gate_decision, list_versions

    result = update("configs/update/ci.yaml", "configs/policy/default.yaml")
    report = Path(result["report"]).read_text()
    assert result["model"] == "smollm2-135m.code-ci"
    assert set(result["candidates"]) == {f"smollm2-135m-code-ci-{m}-s0-e1" for m in ("atlas", "weight-lora")}
    assert ("PROMOTED" in report) == result["promoted"] and ("REJECTED" in report) != result["promoted"]
    counts = ledger_counts(state)
    assert counts["atlases"] == 1 and counts["training_runs"] == 2 and counts["gate_decisions"] == 2
    p = open_platform()
    try:
        model = get_model(p.ledger, result["model"])
        for v in list_versions(p.ledger, model.id):
            if v.is_base:
                continue
            decision = latest_gate_decision(p.ledger, v.id)
            assert v.mlflow_version is not None and decision is not None
            kl = {c.name: c.measured for c in decision.checks if c.name.startswith("kl_vs_base")}
            assert set(kl) == {"kl_vs_base[gsm8k]", "kl_vs_base[csqa]"} and all(x > 0 for x in kl.values())
            target = next(c for c in decision.checks if c.name == "target_gain_vs_champion")
            assert "of 4" in target.detail or "/4" in target.detail  # EvalPlus scored the 4 MBPP+ problems
    finally:
        p.close()
