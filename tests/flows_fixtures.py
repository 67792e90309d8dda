"""Shared pieces of the flow tests: a tiny update config and policies, one Prefect harness.

The tiny cycle runs on a seeded random 4-layer Llama ('tiny-llama') with a byte-level BPE
tokenizer, real MBPP / GSM8K / CSQA rows (a handful of each) and the `response-match`
target scorer, so a whole cycle takes seconds and needs no EvalPlus.

`prefect_harness` is session-scoped: name it as a test argument to use it (one temporary
Prefect server per test session).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

TINY_CONFIG = {
    "name": "tiny",
    "backbone": "tiny-llama",
    "dtype": "float32",
    "skill": "tiny-code",
    "layer": 2,
    "data": {"source": "mbpp", "train_limit": 8, "val_limit": 4},
    "target": {"scorer": "response-match", "options": {"limit": 4, "threshold": 0.5}},
    "retained": {
        "domains": ["gsm8k", "csqa"],
        "kl_contexts": 8,
        "kl_max_tokens": 128,
        "gsm8k_questions": 4,
        "csqa_questions": 6,
        "max_new_tokens": 4,
        "batch_size": 4,
        "replay_examples": 8,
    },
    "atlas": {"num_vectors": 64, "charts": 4, "rank": 4},
    "train": {"epochs": 2, "lr": 1.0e-2, "batch_size": 4, "max_length": 512, "on_bad_example": "truncate"},
}

LOOSE = {"gsm8k": 50.0, "csqa": 50.0}
PASSING_POLICY = {
    "name": "tiny-pass",
    "candidates": {"methods": ["atlas", "weight-lora"], "seeds": [0]},
    "min_target_gain": 0,
    "max_kl_vs_champion": LOOSE,
    "max_kl_vs_base": LOOSE,
    "nfr": {
        "bound": "wilson",
        "confidence": 0.95,
        "max_vs_champion": {"gsm8k": 1.0, "csqa": 1.0},
        "max_vs_base": {"gsm8k": 1.0, "csqa": 1.0},
    },
    "max_csqa_choice_churn": 1.0,
}
# A gain of all four target problems over the champion: allowed (a policy asking for more than
# the target has is refused before training), never reached by the random tiny model.
IMPOSSIBLE_POLICY = PASSING_POLICY | {"name": "tiny-impossible", "min_target_gain": 4}


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def tiny_files(folder: Path, policy: dict = PASSING_POLICY, **config_changes) -> tuple[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    return (
        write_yaml(folder / "update.yaml", TINY_CONFIG | config_changes),
        write_yaml(folder / f"{policy['name']}.yaml", policy),
    )


_HARNESS: list = []


@pytest.fixture(scope="session")
def prefect_harness(request):
    """One temporary Prefect server (SQLite) for every flow test of the session (~8 s to start).

    Test modules import this fixture, and pytest makes one session fixture per importing
    module; the harness itself is therefore kept here and entered once, closed at session end."""
    from contextlib import ExitStack

    from prefect.testing.utilities import prefect_test_harness

    if not _HARNESS:
        stack = ExitStack()
        stack.enter_context(prefect_test_harness(server_startup_timeout=60))
        from prefect.logging.configuration import setup_logging

        # Bind Prefect's console handler now, to the session's stderr: configured lazily inside
        # a test that uses capsys, it would write to capsys's stream after that stream is closed.
        setup_logging()
        _HARNESS.append(stack)
        request.config.add_cleanup(stack.close)
    yield


def use_state(monkeypatch, folder: Path) -> Path:
    """Point the platform at an embedded state folder (ledger, store, MLflow all inside it)."""
    monkeypatch.setenv("ATLAS_STATE_DIR", str(folder))
    for name in ("ATLAS_LEDGER_URL", "ATLAS_ARTIFACT_STORE", "ATLAS_MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    return folder


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    """A fresh project state folder (ledger, store, MLflow) per test."""
    return use_state(monkeypatch, tmp_path / "state")


os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def ledger_counts(state: Path) -> dict[str, int]:
    """Rows per ledger table of a state folder's ledger (to prove reruns add nothing twice)."""
    from sqlalchemy import func, select

    from registry import default_ledger_url, init_db
    from registry import models as m

    tables = {
        "atlases": m.Atlas,
        "training_runs": m.TrainingRun,
        "checkpoints": m.Checkpoint,
        "versions": m.ModelVersion,
        "evaluations": m.Evaluation,
        "answers": m.Answer,
        "gate_decisions": m.GateDecision,
        "releases": m.Release,
    }
    with init_db(default_ledger_url(state)) as ledger, ledger.transaction() as s:
        return {name: s.scalar(select(func.count()).select_from(table)) for name, table in tables.items()}


def stored_metrics_from(monkeypatch, extra: dict):
    """flows.evaluate.stored_metrics of a version (id 9, champion id 1) whose stored evaluation has
    this `extra` (and no KL or churn rows); the ledger reads are faked, so no cycle runs."""
    from types import SimpleNamespace

    import registry
    from flows import evaluate

    ev = SimpleNamespace(
        id=3, release_version_id=1, kl=[], churn=[], target_solved=2, target_total=4, csqa_choice_churn=None
    )
    monkeypatch.setattr(registry, "latest_evaluation", lambda ledger, version_id: ev)
    monkeypatch.setattr(registry, "evaluation_extra", lambda ledger, evaluation_id: extra)
    monkeypatch.setattr(evaluate, "eval_key", lambda ctx: extra.get("eval_key"))
    ctx = SimpleNamespace(champion=SimpleNamespace(version=SimpleNamespace(id=1)))
    version = SimpleNamespace(id=9, name="v9", method="atlas", seed=0, epoch=1, step=4)
    return evaluate.stored_metrics(None, ctx, version)


def _crash_after_checkpoints(config: str, policy: str, after: int) -> None:
    """Run a cycle that dies (SIGKILL: no cleanup at all) right after its `after`-th recorded checkpoint."""
    import signal

    import flows.training as training

    original, seen = training.record_checkpoint_files, set()

    def record_then_die(res, evaluate, training_run_id, path):
        out = original(res, evaluate, training_run_id, path)
        seen.add(str(path))  # recording one again (reconcile) does not count
        if len(seen) >= after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    training.record_checkpoint_files = record_then_die
    from flows.update import update

    update(config, policy)


if __name__ == "__main__":
    import sys

    _crash_after_checkpoints(sys.argv[1], sys.argv[2], int(sys.argv[3]))
