"""Where a cycle keeps its records: ledger, artifact store and MLflow, from the environment.

Embedded default (nothing to start): everything under the state folder
(`atlas_core.paths.state_dir()`, i.e. `$ATLAS_STATE_DIR` or `.atlas_state/`):
    ledger.db              the release ledger (SQLite)
    artifacts/             the content-addressed artifact store
    mlflow/mlflow.db       MLflow tracking + registry (SQLite), mlflow/artifacts/
    prefect/               Prefect's home and its SQLite database (local mode)
    runs/, reports/        training run folders, cycle reports

Multi-host: the same code with URLs in the environment (see docs/FLOWS.md):
    ATLAS_LEDGER_URL              e.g. postgresql://atlas@db:5432/atlas
    ATLAS_ARTIFACT_STORE          a shared folder or fsspec URL (s3://bucket/atlas)
    ATLAS_MLFLOW_TRACKING_URI     e.g. http://mlflow:5000 (registry on the same server)
    ATLAS_MLFLOW_ARTIFACT_ROOT    default mlflow-artifacts:/atlas (proxied by the server)
    PREFECT_API_URL               a Prefect server; unset means Prefect's local mode
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from atlas_core.paths import state_dir

DEFAULT_CONFIG = "configs/update/default.yaml"
DEFAULT_POLICY = "configs/policy/default.yaml"


def configure_environment() -> Path:
    """Settings every entry point needs before Prefect or MLflow are imported; returns the state dir."""
    state = state_dir()
    os.environ.setdefault("PREFECT_HOME", str(state / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a model hub at run time
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # OpenMP threads that spin while waiting make every small op (decoding!) 5-10x slower as
    # soon as another process shares the cores; passive waiting costs nothing on an idle machine.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return state


@dataclass
class Platform:
    state: Path
    ledger: object  # registry.Ledger
    store: object  # registry.ArtifactStore
    bridge: object  # registry.MlflowBridge

    def describe(self) -> dict[str, str]:
        return {
            "state": str(self.state),
            "ledger": _hide_password(self.ledger.url),
            "artifacts": self.store.root_url,
            "mlflow": self.bridge.config.tracking_uri,
        }

    def close(self) -> None:
        self.ledger.close()


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@dataclass(frozen=True)
class PlatformRef:
    """Where a cycle's records live, as plain values: what a stage needs to open the same platform
    in another process (flows/resources.py). None means the embedded default under `state`."""

    state: str
    ledger_url: Optional[str] = None  # ATLAS_LEDGER_URL; None: <state>/ledger.db (SQLite)
    artifact_store: Optional[str] = None  # ATLAS_ARTIFACT_STORE; None: <state>/artifacts
    mlflow_tracking_uri: Optional[str] = None  # ATLAS_MLFLOW_TRACKING_URI; None: <state>/mlflow (SQLite)
    mlflow_artifact_root: str = "mlflow-artifacts:/atlas"  # with a tracking server only

    @classmethod
    def from_environment(cls) -> "PlatformRef":
        env = os.environ.get
        return cls(
            str(state_dir()),
            env("ATLAS_LEDGER_URL") or None,
            env("ATLAS_ARTIFACT_STORE") or None,
            env("ATLAS_MLFLOW_TRACKING_URI") or None,
            env("ATLAS_MLFLOW_ARTIFACT_ROOT") or "mlflow-artifacts:/atlas",
        )


def mlflow_config(state: Path, ref: Optional[PlatformRef] = None):
    from registry import MlflowConfig

    ref = ref or PlatformRef.from_environment()
    if ref.mlflow_tracking_uri:
        return MlflowConfig.server(ref.mlflow_tracking_uri, ref.mlflow_artifact_root)
    return MlflowConfig.local(state)


def open_platform(ref: Optional[PlatformRef] = None) -> Platform:
    """Open (creating or migrating as needed) the ledger, the store and the MLflow bridge of `ref`
    (default: the environment's, PlatformRef.from_environment)."""
    from registry import ArtifactStore, MlflowBridge, default_ledger_url, init_db

    configure_environment()
    ref = ref or PlatformRef.from_environment()
    state = Path(ref.state)
    state.mkdir(parents=True, exist_ok=True)
    config = mlflow_config(state, ref)
    # MLflow's global default is ./mlruns or ./mlflow.db in the working folder; pin it so
    # that nothing (plugins, artifact helpers) ever writes there.
    os.environ["MLFLOW_TRACKING_URI"] = config.tracking_uri
    os.environ["MLFLOW_REGISTRY_URI"] = config.registry_uri or config.tracking_uri
    ledger = init_db(ref.ledger_url or default_ledger_url(state))
    store = ArtifactStore(ref.artifact_store or state / "artifacts")
    return Platform(state, ledger, store, MlflowBridge(config))


@contextmanager
def subflows_without_heartbeats() -> Iterator[None]:
    """Flow runs started inside this block (a cycle's stages: subflows in the cycle's own process) send
    no heartbeat of their own; the enclosing flow run's covers them. Prefect 3.9 gives every flow run a
    heartbeat thread (every 180 s by default) that sleeps in 1 s steps and is joined when the run ends,
    so each subflow ended up to 1 s late: 5.2 s of a 12.1 s tiny-model cycle (cProfile). A flow run a
    worker starts (a `candidate` on a work pool) is not inside the block: it keeps its heartbeat."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield
