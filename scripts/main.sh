#!/usr/bin/env bash
# The main job (installs first): one update cycle of the platform on the built-in SmolLM2-135M
# backbone with the small documented subsets of configs/update/default.yaml and the release
# policy configs/policy/default.yaml. Trains full ATLAS and the Weight-LoRA baseline, evaluates,
# gates, promotes or rejects with reasons, and writes a report. A second run reuses the atlas,
# the training runs and every stored answer, and gates against the first run's champion.
# Extra arguments go to `atlas update` (e.g. --config, --policy).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
# Passive OpenMP waiting: spinning threads slow small ops 5-10x whenever another process shares the cores.
export OMP_WAIT_POLICY=PASSIVE
start=$(date +%s)
.venv/bin/atlas update "$@"
echo "main job finished in $(( $(date +%s) - start )) s"
