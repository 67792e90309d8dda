#!/usr/bin/env bash
# The main job on the embedded default backbone (installs first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/atlas demo "$@"
