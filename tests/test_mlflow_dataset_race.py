"""Two workers logging the same dataset at once: the MLflow server's loser gets a unique violation,
and log_dataset tries once more (the row exists then); any other MLflow error still fails."""

import pytest
from mlflow.exceptions import MlflowException

from registry.mlflow_bridge import MlflowBridge


class _Client:
    def __init__(self, errors):
        self.errors, self.calls = list(errors), 0

    def log_inputs(self, run_id, datasets):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)


def _bridge(errors) -> MlflowBridge:
    bridge = MlflowBridge.__new__(MlflowBridge)
    bridge.__dict__["client"] = _Client(errors)  # the cached property's slot
    return bridge


def test_a_lost_create_race_is_tried_once_more():
    race = MlflowException(
        '(psycopg.errors.UniqueViolation) duplicate key value violates unique constraint "dataset_pk"'
    )
    bridge = _bridge([race])
    bridge.log_dataset("run", "mbpp:train", "a" * 64, "ledger:mbpp")
    assert bridge.client.calls == 2


def test_other_errors_and_a_second_race_fail():
    with pytest.raises(MlflowException, match="RESOURCE_DOES_NOT_EXIST"):
        _bridge([MlflowException("RESOURCE_DOES_NOT_EXIST: run")]).log_dataset("run", "d", "a" * 64, "s")
    race = MlflowException("UNIQUE constraint failed: datasets.dataset_uuid")
    with pytest.raises(MlflowException, match="UNIQUE"):
        _bridge([race, race]).log_dataset("run", "d", "a" * 64, "s")
