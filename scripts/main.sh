#!/usr/bin/env bash
# The main job (installs first): the continual demo on the built-in SmolLM2-135M backbone. Two
# releases in sequence on the line `assistant`:
#   v1 teaches code (configs/update/default.yaml: MBPP train -> MBPP+ pass@1; ATLAS and Weight-LoRA);
#   v2 teaches the GSM8K solution format on top of v1 (configs/update/gsm8k-format.yaml: reference
#      NLL of held-out solutions), with code now a retained domain (KL + MBPP+ no-regression).
# Then the line's history. A second run is idle: both snapshots are already in the champion's chain.
# Extra arguments go to both `atlas update` calls (e.g. --snapshot is not meant here; --backbone is).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
# Passive OpenMP waiting: spinning threads slow small ops 5-10x whenever another process shares the cores.
export OMP_WAIT_POLICY=PASSIVE
start=$(date +%s)
echo "== release v1: code =="
.venv/bin/atlas update --config configs/update/default.yaml --policy configs/policy/default.yaml "$@"
v1=$(date +%s)
echo "== release v2: GSM8K solution format, on top of v1 =="
.venv/bin/atlas update --config configs/update/gsm8k-format.yaml --policy configs/policy/gsm8k-format.yaml "$@"
echo "== the line's history =="
.venv/bin/atlas history --line assistant
echo "main job finished in $(( $(date +%s) - start )) s (v1 $(( v1 - start )) s, v2 $(( $(date +%s) - v1 )) s)"
