"""The published baselines as policy candidates of a real (tiny) cycle: the ones that need the
retained o_proj statistics get them from the cycle's calibration contexts, computed once and
stored by content; every candidate is trained, evaluated, gated and loadable as a release."""

from __future__ import annotations

import torch

from tests.flows_fixtures import PASSING_POLICY, TINY_CONFIG, tiny_files

METHODS = ["lora-null", "o-lora", "corda-kpm", "oplora-k16", "clora", "toplora", "stm", "talr"]


def test_every_baseline_is_a_policy_candidate(prefect_harness, state, tmp_path):
    from flows import load_release
    from flows.update import update
    from registry import get_model, list_versions

    policy = PASSING_POLICY | {"name": "baselines", "candidates": {"methods": METHODS, "seeds": [0]}}
    config, policy_file = tiny_files(
        tmp_path / "cfg", policy, evaluate="final", train=TINY_CONFIG["train"] | {"epochs": 1}
    )
    result = update(config, policy_file)
    assert len(result.candidates) == len(METHODS), result.candidates
    stats = list((state / "retained-stats").glob("*.safetensors"))
    assert len(stats) == 1  # one (backbone, layer, retained data) key shared by the three methods that need it

    from flows.platform import open_platform

    p = open_platform()
    try:
        versions = [v for v in list_versions(p.ledger, get_model(p.ledger, result.model).id) if not v.is_base]
    finally:
        p.close()
    assert sorted(v.method for v in versions) == sorted(METHODS)
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    base = load_release(result.model, "base", dtype="float32")
    with torch.no_grad():
        base_logits = base.model(ids).logits
        for v in versions:  # each saved delta applies as a chain delta and changes the model ...
            moved = (load_release(result.model, v.name, dtype="float32").model(ids).logits - base_logits).abs().max()
            # ... except STM's: on a random model every response token's f0 NLL (about ln 400) exceeds
            # ln 2.5, so STM masks them all and B stays 0
            assert (moved == 0) if v.method == "stm" else (moved > 0), v.method
