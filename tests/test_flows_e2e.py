"""End-to-end: the two-release demo on the real default backbone (SmolLM2-135M) with the CI subsets.

v1 (configs/update/ci.yaml) teaches code: 4 MBPP+ problems scored by EvalPlus, 8 GSM8K / 8 CSQA
questions, 16 KL contexts, one short epoch of ATLAS and Weight-LoRA. v2 (configs/update/ci-v2.yaml)
teaches the GSM8K solution format on top of it (reference NLL), with code retained. The policy
(configs/policy/ci.yaml) rejects only broken measurements, so the outcome is fixed and asserted.
Slow, but run in CI: a few minutes on 2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.flows_fixtures import ledger_counts

pytestmark = pytest.mark.slow


def test_two_releases_on_the_default_backbone(prefect_harness, state, tmp_path):
    from flows.platform import open_platform
    from flows.update import update
    from registry import alias_holder, get_model, latest_gate_decision, list_versions, version_chain

    first = update("configs/update/ci.yaml", "configs/policy/ci.yaml")
    assert first.model == "smollm2-135m.ci-demo" and first.outcome == "promoted"
    assert set(first.candidates) == {f"smollm2-135m-code-ci-{m}-s0-e1" for m in ("atlas", "weight-lora")}
    assert "PROMOTED" in Path(first.report).read_text()
    counts = ledger_counts(state)
    assert counts["atlases"] == 1 and counts["training_runs"] == 2 and counts["gate_decisions"] == 2
    p = open_platform()
    try:
        model = get_model(p.ledger, first.model)
        for v in list_versions(p.ledger, model.id):
            if v.is_base:
                continue
            decision = latest_gate_decision(p.ledger, v.id)
            assert v.mlflow_version is not None and decision is not None
            kl = {c.name: c.measured for c in decision.checks if c.name.startswith("kl_vs_base")}
            assert set(kl) == {"kl_vs_base[gsm8k]", "kl_vs_base[csqa]"} and all(x > 0 for x in kl.values())
            target = next(c for c in decision.checks if c.name == "target_gain_vs_champion")
            assert "/4" in target.detail  # EvalPlus scored the 4 MBPP+ problems
    finally:
        p.close()

    second = update("configs/update/ci-v2.yaml", "configs/policy/ci.yaml")
    assert second.outcome == "promoted" and second.previous_champion == first.champion
    p = open_platform()
    try:
        v2 = alias_holder(p.ledger, model.id)
        assert v2.name == second.champion and v2.skill == "gsm8k-format"
        assert [v.name for v in version_chain(p.ledger, v2.id)] == [first.champion, v2.name]  # v2's parent is v1
        checks = {c.name: c for c in latest_gate_decision(p.ledger, v2.id).checks}
        code = checks["no_regression[code-ci]"]  # MBPP+ of the released code skill, champion vs candidate
        assert code.passed and code.measured is not None and "on 4 problems" in code.detail
        assert checks["kl_vs_champion[code-ci]"].measured > 0 and checks["target_gain_vs_champion"].measured > 0
        assert ledger_counts(state)["atlases"] == 2  # refitted on v1's activations
    finally:
        p.close()
    again = update("configs/update/ci.yaml", "configs/policy/ci.yaml")
    assert again.outcome == "idle"  # code's snapshot is already in the champion's chain
