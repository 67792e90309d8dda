"""Tasks retry only what can be transient: a lost connection yes, a deterministic error never."""

from __future__ import annotations

import importlib

import pytest
from sqlalchemy.exc import OperationalError

from flows.retries import is_transient, transient_only

MODULES = ["flows.update", "flows.refresh", "flows.training", "flows.evaluate", "flows.release"]


@pytest.mark.parametrize(
    "error, transient",
    [
        (ConnectionError("reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (OperationalError("SELECT 1", {}, Exception("server closed the connection")), True),
        (ValueError("shape (4, 64) vs (4, 32)"), False),
        (FloatingPointError("loss diverged"), False),
        (RuntimeError("CUDA out of memory"), False),
        (KeyError("gsm8k"), False),
        (FileNotFoundError("x"), False),
    ],
)
def test_which_errors_are_transient(error, transient):
    assert is_transient(error) is transient
    wrapped = RuntimeError("task failed")
    wrapped.__cause__ = error
    assert is_transient(wrapped) is transient  # a cause is looked through


def test_every_retrying_task_retries_only_transient_errors():
    from prefect import Task

    tasks = {
        f"{m}.{name}": obj
        for m in MODULES
        for name, obj in vars(importlib.import_module(m)).items()
        if isinstance(obj, Task)
    }
    retrying = {name: t for name, t in tasks.items() if t.retries}
    assert {"flows.training.train_run", "flows.evaluate.kl_against", "flows.release.move_champion"} <= set(retrying)
    assert [name for name, t in retrying.items() if t.retry_condition_fn is not transient_only] == []


def test_a_deterministic_failure_runs_once_and_a_transient_one_is_retried(prefect_harness):
    from prefect import task

    calls = []

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=transient_only)
    def flaky(error: str) -> int:
        calls.append(error)
        if len(calls) == 1 or error == "shape":
            raise ConnectionError("lost") if error == "net" else ValueError("shape mismatch")
        return len(calls)

    assert flaky("net") == 2 and calls == ["net", "net"]
    calls.clear()
    with pytest.raises(ValueError):
        flaky("shape")
    assert calls == ["shape"]
