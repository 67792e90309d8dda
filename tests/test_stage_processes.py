"""A stage run alone in a fresh process, from its serialised inputs, records what it records inside a
cycle: what fan-out over worker processes needs (each candidate's stages elsewhere, one ledger).

The in-cycle run: resolve_lineage -> refresh_atlas -> train_skill -> evaluate_candidate -> gate in
this process, one resources scope. Before refresh and before evaluation the whole state folder
(ledger, store, MLflow) is copied; a fresh interpreter then runs the remaining stages on each copy,
its inputs sent as JSON (the CycleContext through pydantic, as Prefect sends a deployment's
parameters) and the copy's PlatformRef in place of the original. Its records must equal the
in-cycle ones: the atlas (content hash, file sha256), the trained versions and their adapters'
sha256, every metric of the evaluation and every gate check.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from tests.flows_fixtures import PASSING_POLICY, tiny_files

REPO = Path(__file__).resolve().parent.parent
ATLAS_ONLY = PASSING_POLICY | {"candidates": {"methods": ["atlas"], "seeds": [0]}}

# The stages after the copy point, in a fresh interpreter: argv = stage list, the JSON context file,
# the copy's state folder, the output pickle.
STAGES = """
import pickle, sys
from dataclasses import replace
from pathlib import Path

from pydantic import TypeAdapter

from flows.cycle import CycleContext
from flows.evaluate import evaluate_candidate
from flows.platform import PlatformRef
from flows.refresh import refresh_atlas
from flows.release import gate
from flows.training import train_skill

stages, ctx_json, state, out = sys.argv[1].split(","), Path(sys.argv[2]).read_text(), sys.argv[3], sys.argv[4]
ctx = TypeAdapter(CycleContext).validate_json(ctx_json)
ctx = replace(ctx, platform=PlatformRef(state))  # the same records, in the copy
got = {}
if "refresh" in stages:
    got["atlas"] = refresh_atlas(ctx, "local")
    ctx = replace(ctx, atlases=(got["atlas"],))
if "train" in stages:
    got["versions"] = train_skill(ctx)
if "evaluate" in stages:
    got["metrics"] = [evaluate_candidate(ctx, v) for v in sorted(int(v) for v in sys.argv[5].split(","))]
    got["gate"] = gate(ctx, got["metrics"])
Path(out).write_bytes(pickle.dumps(got))
"""


def _run_alone(stages: str, ctx, state: Path, tmp: Path, *extra: str) -> dict:
    from prefect.settings import PREFECT_API_URL
    from pydantic import TypeAdapter

    from flows.cycle import CycleContext

    ctx_file, out = tmp / f"{stages}.ctx.json", tmp / f"{stages}.out.pickle"
    ctx_file.write_bytes(TypeAdapter(CycleContext).dump_json(ctx))
    env = os.environ | {"PYTHONPATH": str(REPO), "ATLAS_STATE_DIR": str(state)}
    env |= {"PREFECT_API_URL": PREFECT_API_URL.value()}  # the test's Prefect server
    done = subprocess.run(
        [sys.executable, "-c", STAGES, stages, str(ctx_file), str(state), str(out), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{stages} in a fresh process failed:\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
    return pickle.loads(out.read_bytes())


def _adapters(state: Path, versions: list[int]) -> list[str]:
    from registry import default_ledger_url, get_version, init_db

    with init_db(default_ledger_url(state)) as ledger:
        return [get_version(ledger, v).adapter_sha256 for v in versions]


def test_each_stage_in_a_fresh_process_records_what_it_records_in_the_cycle(prefect_harness, state, tmp_path):
    from flows.config import load_update_config
    from flows.evaluate import evaluate_candidate
    from flows.lineage import resolve_lineage
    from flows.platform import PlatformRef
    from flows.policy import load_policy
    from flows.refresh import refresh_atlas
    from flows.release import gate
    from flows.resources import scope
    from flows.training import train_skill

    config, policy = tiny_files(tmp_path / "cfg", ATLAS_ONLY)
    cfg = load_update_config(config)
    pol, ref = load_policy(policy, cfg.domain_names), PlatformRef.from_environment()
    copies = tmp_path / "copies"
    with scope(ref):
        ctx = resolve_lineage(cfg, pol, ref)
        shutil.copytree(state, copies / "before-refresh")
        atlas = refresh_atlas(ctx, "local")
        ctx = replace(ctx, atlases=(atlas,))
        versions = train_skill(ctx)
        shutil.copytree(state, copies / "before-evaluation")
        metrics = [evaluate_candidate(ctx, v) for v in sorted(versions)]
        outcome = gate(ctx, metrics)
    assert len(versions) == 2 and all(m.evaluation_id for m in metrics)

    # refresh + train from the lineage's context alone: the same atlas, the same versions and adapters
    fresh = _run_alone("refresh,train", replace(ctx, atlases=()), copies / "before-refresh", tmp_path)
    same_atlas = (fresh["atlas"].content_hash, fresh["atlas"].sha256, fresh["atlas"].atlas_id)
    assert same_atlas == (atlas.content_hash, atlas.sha256, atlas.atlas_id)
    assert sorted(fresh["versions"]) == sorted(versions)
    assert _adapters(copies / "before-refresh", versions) == _adapters(state, versions)

    # evaluate + gate of the trained candidates: every metric and every check as in the cycle
    ids = ",".join(str(v) for v in sorted(versions))
    fresh = _run_alone("evaluate", ctx, copies / "before-evaluation", tmp_path, ids)
    assert fresh["metrics"] == metrics
    assert json.dumps(fresh["gate"].checks, default=repr) == json.dumps(outcome.checks, default=repr)
    assert fresh["gate"].selected == outcome.selected
