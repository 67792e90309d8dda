#!/usr/bin/env bash
# The whole test suite, slow end-to-end tests included (installs first, lints, then pytest). Extra args go to pytest.
# ATLAS_VENV / ATLAS_CONSTRAINTS as in install.sh: which venv, installed from which constraints
# (tests/test_lock.py checks that venv against the same file; scripts/lock.sh sets both).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
# Passive OpenMP waiting: spinning threads slow small ops 5-10x whenever another process shares the cores.
export OMP_WAIT_POLICY=PASSIVE
# Lint and format check first (pyproject.toml [tool.ruff]): a style failure costs seconds, not a suite.
# ATLAS_SKIP_LINT=1 skips it (scripts/lock.sh's run: the lock is about packages, not style).
if [ -z "${ATLAS_SKIP_LINT:-}" ]; then
  "${ATLAS_VENV:-.venv}/bin/ruff" check .
  "${ATLAS_VENV:-.venv}/bin/ruff" format --check .
fi
# -rs: every skipped test with its reason; under CI=true a skip fails the run (tests/ci_plugin.py).
exec "${ATLAS_VENV:-.venv}/bin/python" -m pytest -q -rs -p no:cacheprovider "$@"
