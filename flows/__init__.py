"""Prefect flows that compose atlas_core, evaluation and registry into the update cycle.

    update            the whole cycle (flows/update.py), typed stages (flows/cycle.py)
      resolve_lineage backbone, line, champion chain, skills -> CycleContext (flows/update.py)
      refresh_atlas   reuse or fit the retained atlas (flows/refresh.py)
      run_candidates  every method x seed as one `candidate` flow each, here or on a work pool (flows/candidates.py):
        train_candidate     train one delta, checkpoints recorded as they appear (flows/training.py)
        evaluate_candidate  target score, retained KL, answers, churn (flows/evaluate.py)
      gate / promote  release policy checks, selection, champion move (flows/release.py)
    rollback          move champion back (flows/release.py)
    load_release      a version as a ready transformers model (flows/serving.py; MLflow pyfunc: flows/pyfunc.py)
    submit_candidate  an adapter trained elsewhere as a candidate version (flows/submit.py)
    gate_candidate    the gate for one existing candidate, e.g. a submitted one (flows/gate_check.py)
    squash_version    a chain of LoRA-family deltas as one candidate delta on the base (flows/squash.py)
    add_snapshot      a skill's new data, written complete, announced as an event (flows/snapshots.py, flows/events.py)

Configs: flows/config.py (UpdateConfig, configs/update/), flows/policy.py (ReleasePolicy,
configs/policy/). Where state lives: flows/platform.py (PlatformRef); what the stages compute with
(the opened platform, backbone, deltas, atlases, KL caches): flows/resources.py. Importing this
package changes nothing; entry points (`atlas`, flows.platform.open_platform) set the environment
(flows.platform.configure_environment: Prefect's home under the state folder, offline hub, ...).
"""

from types import MappingProxyType

# The public functions, imported on first use: they bring torch, transformers and Prefect, which
# the operational commands (`atlas rollback`, `status`, ...) must not wait for.
_LAZY = MappingProxyType({"load_release": ".serving", "submit_candidate": ".submit", "squash_version": ".squash"})


def __getattr__(name: str):
    """`flows.load_release` (use a release), `flows.submit_candidate` (an adapter trained elsewhere joins a
    line) and `flows.squash_version` (a LoRA-only chain as one candidate delta)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
