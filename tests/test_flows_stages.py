"""The cycle's stages run one by one on plain values: each validates its parameters, returns a
frozen value that survives pickling and Prefect's result persistence, and needs nothing from an
earlier stage but those values (resources are opened again in a fresh scope, or another process)."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from tests.flows_fixtures import PASSING_POLICY, tiny_files

ATLAS_ONLY = PASSING_POLICY | {"candidates": {"methods": ["atlas"], "seeds": [0]}}


def _inputs(tmp_path: Path, policy: dict = ATLAS_ONLY):
    from flows.config import load_update_config
    from flows.policy import load_policy

    config, policy_file = tiny_files(tmp_path / "cfg", policy)
    cfg = load_update_config(config)
    return cfg, load_policy(policy_file, cfg.domain_names)


def test_each_stage_runs_alone_on_the_values_of_the_one_before(prefect_harness, state, tmp_path):
    from flows.cycle import AtlasRef, CycleContext
    from flows.evaluate import evaluate_candidate
    from flows.lineage import resolve_lineage
    from flows.metrics import CandidateMetrics
    from flows.platform import PlatformRef
    from flows.refresh import refresh_atlas
    from flows.release import GateOutcome, gate, promote
    from flows.resources import CURRENT, prefix_serves, scope
    from flows.training import train_skill
    from registry import ReleaseInfo, latest_gate_decision

    cfg, pol = _inputs(tmp_path)
    ref = PlatformRef.from_environment()
    with scope(ref) as res:
        ctx = resolve_lineage(cfg, pol, ref)
        assert isinstance(ctx, CycleContext) and ctx.champion.version.is_base and ctx.champion.deltas == ()
        assert ctx.champion_id is None and ctx.released == () and ctx.layer == 2 and ctx.kl_layer == 1
        fitted = refresh_atlas(ctx, "local")
        assert isinstance(fitted, AtlasRef) and Path(fitted.path).is_file()
        assert {"backbones", "atlas_paths", "atlases"} <= set(res.held())  # what the stages computed with
    # the scope's end freed the backbone, the ledger and every cache, and nothing is current any more
    assert CURRENT.get() is None and res.held() == {}

    with scope(ref) as res:  # as a new process would: only the plain values carry over
        ctx = pickle.loads(pickle.dumps(ctx))
        stored = refresh_atlas(ctx, "local")  # reused by content hash, fetched and verified
        assert (stored.atlas_id, stored.sha256, stored.content_hash) == (
            fitted.atlas_id,
            fitted.sha256,
            fitted.content_hash,
        )
        ctx = replace(ctx, atlases=(stored,))
        versions = train_skill(ctx)
        assert len(versions) == 2  # one candidate per epoch end
        metrics = [evaluate_candidate(ctx, v) for v in versions]
        assert all(isinstance(m, CandidateMetrics) and m.evaluation_id for m in metrics)
        assert all(set(m.kl_vs_base) == set(m.kl_vs_champion) == {"gsm8k", "csqa"} for m in metrics)
        assert evaluate_candidate(ctx, versions[0]) == metrics[0]  # the stored evaluation, read back

        # The gate alone, on a hand-made record: a NaN fails closed and the decision is recorded.
        broken = replace(metrics[0], kl_vs_base={"gsm8k": math.nan, "csqa": 0.0}, evaluation_id=None)
        rejected = gate(ctx, [broken])
        assert not rejected.verdict(broken.version_id) and rejected.selected is None
        assert latest_gate_decision(res.ledger, broken.version_id).id == rejected.decisions[broken.version_id]

        outcome = gate(ctx, metrics)
        assert isinstance(outcome, GateOutcome) and set(outcome.decisions) == set(versions)
        assert outcome.selected is not None and pickle.loads(pickle.dumps(outcome)) == outcome
        release = promote(ref, outcome.selected.version_id, "stage test", None)
        assert isinstance(release, ReleaseInfo) and release.version_id == outcome.selected.version_id

        after = resolve_lineage(cfg, pol, ref)
        assert after.champion_id == release.version_id and [v.id for v in after.champion.deltas] == [release.version_id]
        assert after.champion.lowest_layer == 2 and after.kl_layer == 1 and after.base == ctx.base

    # A later process reads the KL and CSQA-choice prefix states and the KL references from disk (by
    # content) instead of recomputing them, and measures the same KL and choices to the last bit.
    stored_files = sorted((state / "cache" / "kl-states").glob("*.safetensors"))
    assert len(stored_files) == 5  # KL prefix states and the base's reference per domain, the choice prefix
    with scope(ref) as res:
        from registry import get_answers, get_version

        candidate = res.resolve_applied(get_version(res.ledger, versions[0]))
        model = res.backbone(ctx.backbone).model
        calls = []
        hook = model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
        try:
            again = {m: res.retained_kl(ctx, candidate, [ctx.base], m)[0].mean for m in ("gsm8k", "csqa")}
            choices = res.csqa_answers(ctx, candidate)
            assert calls == [] and again == metrics[0].kl_vs_base
            # A version changing layer kl_layer (as far as the resources know) gets full forwards: the
            # same answers here, since this candidate's residual really sits above it.
            assert not prefix_serves(ctx, replace(candidate, lowest_layer=ctx.kl_layer))
            full = res.csqa_answers(ctx, replace(candidate, lowest_layer=ctx.kl_layer))
            assert len(calls) == math.ceil(cfg.retained.csqa_questions / cfg.retained.batch_size)
        finally:
            hook.remove()
        stored = {
            q: (a.answer, a.correct) for (d, q), a in get_answers(res.ledger, versions[0]).items() if d == "csqa-choice"
        }
        assert {a.id: (a.answer, a.correct) for a in choices} == stored == {a.id: (a.answer, a.correct) for a in full}
        assert len(stored) == cfg.retained.csqa_questions


def test_choice_prefix_states_serve_versions_that_leave_their_layers_unchanged():
    from types import SimpleNamespace

    from flows.cycle import Applied
    from flows.resources import prefix_serves

    ctx = SimpleNamespace(kl_layer=1)  # a line whose lowest changed layer is 2
    assert prefix_serves(ctx, Applied(None)) and prefix_serves(ctx, Applied(None, (), 2))
    assert not prefix_serves(ctx, Applied(None, (), 1)) and not prefix_serves(ctx, Applied(None, (), 0))
    assert not prefix_serves(SimpleNamespace(kl_layer=-1), Applied(None))  # a delta at layer 0: no prefix at all


def test_stages_validate_their_parameters(prefect_harness, state, tmp_path):
    from prefect.exceptions import ParameterTypeError

    from flows.evaluate import evaluate_candidate
    from flows.lineage import resolve_lineage
    from flows.platform import PlatformRef
    from flows.refresh import refresh_atlas
    from flows.release import gate, promote
    from flows.resources import scope

    cfg, pol = _inputs(tmp_path)
    ref = PlatformRef.from_environment()
    with scope(ref):
        with pytest.raises(ParameterTypeError, match="ctx"):
            evaluate_candidate("a context", 1)
        with pytest.raises(ParameterTypeError, match="policy"):
            resolve_lineage(cfg, "configs/policy/default.yaml", ref)  # a path, not a loaded policy
        ctx = resolve_lineage(cfg, pol, ref)
        with pytest.raises(ParameterTypeError, match="variant"):
            refresh_atlas(ctx, ["local"])
        with pytest.raises(ParameterTypeError, match="candidates"):
            gate(ctx, [{"version_id": "two"}])
        with pytest.raises(ParameterTypeError, match="version_id"):
            promote(ref, "seven", "reason")


def test_a_stage_result_is_persisted_and_read_back(prefect_harness, state, tmp_path):
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    from flows.lineage import resolve_lineage
    from flows.platform import PlatformRef
    from flows.resources import scope

    cfg, pol = _inputs(tmp_path)
    ref = PlatformRef.from_environment()
    results = tmp_path / "results"
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: str(results)}), scope(ref):
        ctx = resolve_lineage.with_options(persist_result=True)(cfg, pol, ref)
    (stored,) = results.iterdir()
    record = ResultStore(result_storage=LocalFileSystem(basepath=str(results))).read(stored.name)
    assert record.result == ctx and record.result.champion.version.name.endswith("-base")
