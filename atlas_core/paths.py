"""Where the project keeps its state and finds its data.

State (model caches, atlases, adapters, MLflow/Prefect/ledger files, EvalPlus ground truth)
lives in one project-local folder so that a user can inspect or delete it in one place.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def state_dir() -> Path:
    """`$ATLAS_STATE_DIR`, else `<project>/.atlas_state` (git-ignored). Created on demand."""
    path = Path(os.environ.get("ATLAS_STATE_DIR", PROJECT_ROOT / ".atlas_state")).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """`$ATLAS_DATA_DIR`, else `../shared/data` next to the project when it exists,
    else `<state>/data` (where `atlas data download` puts the files)."""
    if "ATLAS_DATA_DIR" in os.environ:
        return Path(os.environ["ATLAS_DATA_DIR"]).expanduser()
    shared = PROJECT_ROOT.parent / "shared" / "data"
    if shared.is_dir():
        return shared
    return state_dir() / "data"
