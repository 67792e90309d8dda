"""Moved: these read-only ledger queries are registry's public API now (registry/queries.py).

Kept as a re-export so that existing imports work until the callers import from registry.
"""
from registry import (  # noqa: F401
    atlas_files,
    evaluation_extra,
    find_training_run,
    recent_decisions,
    recent_training_runs,
    run_checkpoints,
)
