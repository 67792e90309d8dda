"""The MLflow side: experiments, runs, registered model versions and aliases.

Everything goes through one `MlflowClient` built from an explicit `MlflowConfig`; nothing
touches MLflow's process-global state, because its defaults depend on the working
directory. An experiment and a registered model are made per line (`<backbone>.<line>`);
the ledger decides what MLflow shows (see `promotion.repair`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from mlflow import MlflowClient

# mlflow is imported when a bridge first talks to MLflow (about 2 s with its store's schema
# check), not when the platform opens: `atlas status`, `history` or `gate --explain` never do.

MANAGED_ALIASES = ("champion", "candidate")
_MAX_PARAM_LEN = 6000  # MLflow's limit is 6000 characters per param value


@dataclass(frozen=True)
class MlflowConfig:
    """Where MLflow keeps runs (tracking_uri), model registry and artifacts."""

    tracking_uri: str
    artifact_root: str
    registry_uri: Optional[str] = None

    @classmethod
    def local(cls, state_dir: str | Path) -> "MlflowConfig":
        """The embedded default: a SQLite file and an artifact folder under the state folder."""
        root = Path(state_dir).expanduser().resolve() / "mlflow"
        root.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts"))

    @classmethod
    def server(cls, url: str, artifact_root: str = "mlflow-artifacts:/atlas") -> "MlflowConfig":
        """A team's MLflow server; artifacts go through its proxy unless a store URL is given."""
        return cls(url, artifact_root)


@dataclass(frozen=True)
class PyfuncModel:
    """How a release folder becomes an MLflow pyfunc model. The caller supplies it (the registry
    holds no model code): a `mlflow.pyfunc.PythonModel` whose `load_context` reads
    `context.artifacts["release"]`, with its signature, input example and requirements."""

    python_model: Any
    signature: Any = None
    input_example: Any = None
    pip_requirements: Optional[list[str]] = None


def _mlflow_error() -> type[Exception]:
    """MLflow's exception class (evaluated only when an exception is being matched)."""
    from mlflow.exceptions import MlflowException

    return MlflowException


def _lost_create_race(error: Exception) -> bool:
    """An MLflow server error from a concurrent insert of the same row (PostgreSQL, MySQL or SQLite wording)."""
    text = str(error)
    return any(m in text for m in ("UniqueViolation", "duplicate key", "UNIQUE constraint failed", "Duplicate entry"))


def experiment_name(backbone: str, line: str) -> str:
    return f"{backbone} / {line}"


class MlflowBridge:
    """Thin, explicit wrapper over `MlflowClient` with the platform's naming rules."""

    def __init__(self, config: MlflowConfig) -> None:
        self.config = config

    @cached_property
    def client(self) -> "MlflowClient":
        import logging

        # Before mlflow is first imported here: no usage reports from inside a training platform.
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
        from mlflow import MlflowClient

        # Creating or migrating MLflow's own database logs at INFO on stderr; a command's output is ours.
        for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
            logging.getLogger(name).setLevel(logging.WARNING)
        return MlflowClient(
            tracking_uri=self.config.tracking_uri, registry_uri=self.config.registry_uri or self.config.tracking_uri
        )

    # -- experiments and runs ---------------------------------------------------------
    def experiment_id(self, backbone: str, line: str) -> str:
        """The experiment of a line, created with an explicit artifact location."""
        name = experiment_name(backbone, line)
        existing = self.client.get_experiment_by_name(name)
        if existing is not None:
            return existing.experiment_id
        folder = f"{backbone.replace('/', '--')}.{line}"
        location = f"{self.config.artifact_root.rstrip('/')}/{folder}"
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except _mlflow_error():
            # Another process created it between our lookup and our create.
            existing = self.client.get_experiment_by_name(name)
            if existing is None:
                raise
            return existing.experiment_id

    def start_run(
        self, backbone: str, line: str, run_name: str, params: dict[str, Any], tags: Optional[dict[str, str]] = None
    ) -> str:
        run = self.client.create_run(
            self.experiment_id(backbone, line),
            run_name=run_name,
            tags={"backbone": backbone, "line": line, **(tags or {})},
        )
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k), str(v)[:_MAX_PARAM_LEN]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        """Metrics of one checkpoint, indexed by training step."""
        now = int(time.time() * 1000)
        from mlflow.entities import Metric

        items = [Metric(k, float(v), now, int(step)) for k, v in sorted(metrics.items())]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def log_dataset(self, run_id: str, name: str, sha256: str, source: str, context: str = "training") -> None:
        """A dataset input of a run (`mlflow.log_input`), identified by content: MLflow keeps at most
        36 characters of digest, so the digest is the sha256's first 32 and `source` holds all of it."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        dataset = Dataset(name=name, digest=sha256[:32], source_type="ledger", source=source)
        inputs = [DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, context)])]
        try:
            self.client.log_inputs(run_id, datasets=inputs)
        except _mlflow_error() as e:
            # Two candidates of one cycle, on two workers, log the same dataset at once: the MLflow server's
            # get-or-create of the dataset row races, and the loser's whole request rolls back with a unique
            # violation (seen on PostgreSQL in tests/test_fan_out.py). The row now exists: once more finds it.
            if not _lost_create_race(e):
                raise
            self.client.log_inputs(run_id, datasets=inputs)

    def log_folder(self, run_id: str, folder: str | Path, artifact_path: str) -> None:
        self.client.log_artifacts(run_id, str(folder), artifact_path)

    def log_pyfunc(self, run_id: str, artifact_path: str, release_folder: str | Path, model: PyfuncModel) -> None:
        """Save `release_folder` as a pyfunc model (MLmodel, environment, artifacts/release) and log it."""
        import tempfile

        import mlflow.pyfunc

        with tempfile.TemporaryDirectory(prefix="registry-pyfunc-") as tmp:
            path = Path(tmp) / "model"
            mlflow.pyfunc.save_model(
                str(path),
                python_model=model.python_model,
                artifacts={"release": str(release_folder)},
                signature=model.signature,
                input_example=model.input_example,
                pip_requirements=model.pip_requirements,
            )
            self.log_folder(run_id, path, artifact_path)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_table(self, run_id: str, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows (dicts with the same keys) as an MLflow table artifact (`artifact_file`: .json),
        shown in the UI's evaluation view; MLflow appends to a table the run already has."""
        if rows:
            self.client.log_table(run_id, data={k: [r[k] for r in rows] for k in rows[0]}, artifact_file=artifact_file)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)

    def set_run_status(self, run_id: str, status: str) -> None:
        """RUNNING (a resumed run), FINISHED or FAILED (with its end time)."""
        if status == "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        else:
            self.client.set_terminated(run_id, status)

    def run_artifact_uri(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.artifact_uri

    # -- registered models, versions, aliases ------------------------------------------
    def ensure_registered_model(self, name: str, description: str = "") -> None:
        try:
            self.client.get_registered_model(name)
        except _mlflow_error():
            try:
                self.client.create_registered_model(name, description=description)
            except _mlflow_error():
                self.client.get_registered_model(name)  # created concurrently: fine

    def create_version(
        self, model_name: str, run_id: str, artifact_path: str, tags: dict[str, str], description: str
    ) -> str:
        """A model version whose files are the run's artifacts under `artifact_path`."""
        source = f"{self.run_artifact_uri(run_id)}/{artifact_path}"
        version = self.client.create_model_version(
            model_name, source=source, run_id=run_id, tags={k: str(v) for k, v in tags.items()}, description=description
        )
        return str(version.version)

    def find_version(self, model_name: str, tag: str, value: str) -> Optional[str]:
        """The version of `model_name` carrying tag=value (used to avoid duplicate versions)."""
        for version in self.client.search_model_versions(f"name = '{model_name}'"):
            if version.tags.get(tag) == value:
                return str(version.version)
        return None

    def set_version_tags(self, model_name: str, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(model_name, version, key, str(value))

    def version_tags(self, model_name: str, version: str) -> dict[str, str]:
        return dict(self.client.get_model_version(model_name, version).tags)

    def aliases(self, model_name: str) -> dict[str, str]:
        """alias -> version for a registered model ({} when the model does not exist)."""
        try:
            model = self.client.get_registered_model(model_name)
        except _mlflow_error():
            return {}
        return {alias: str(version) for alias, version in model.aliases.items()}

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(model_name, alias, version)

    def delete_alias(self, model_name: str, alias: str) -> None:
        self.client.delete_registered_model_alias(model_name, alias)

    def download_version(self, model_name: str, alias_or_version: str, destination: str | Path) -> Path:
        """Download the files of a version (given by alias or number) to a local folder."""
        import mlflow.artifacts

        if alias_or_version.isdigit():
            version = alias_or_version
        else:
            version = self.client.get_model_version_by_alias(model_name, alias_or_version).version
        uri = self.client.get_model_version_download_uri(model_name, str(version))
        path = mlflow.artifacts.download_artifacts(
            artifact_uri=uri, dst_path=str(destination), tracking_uri=self.config.tracking_uri
        )
        return Path(path)
