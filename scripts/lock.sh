#!/usr/bin/env bash
# Refresh constraints.txt: a separate venv with the newest versions pyproject.toml allows, its
# freeze as the candidate lock, the whole suite with CI=true on that venv against that candidate
# (tests/test_lock.py included), and only if it passes, the candidate becomes constraints.txt
# (temp file + rename). The developer's .venv is not touched while it runs (about 20 minutes).
#
# Local version labels are stripped (torch==2.13.0+cpu -> torch==2.13.0): a machine without the
# local CPU wheel cannot install `+cpu`, and pip's `==2.13.0` matches 2.13.0+cpu where it exists
# (and prefers it: a local version sorts above its public one).
#
# Afterwards the lock venv is removed, not moved over .venv: a venv cannot be moved (its console
# scripts - atlas, prefect, mlflow - name its python by absolute path), and replacing .venv under
# a running test or job would break it. .venv follows the new lock by itself: the next
# install.sh/test.sh/main.sh sees a new stamp and installs constraints.txt into it in place (a
# package the new lock dropped stays there; tests/test_lock.py names it: then rm -rf .venv).
# On failure the lock venv and its candidate are kept for a look; the next run starts afresh.
# ATLAS_LOCK_VENV: where the lock venv goes (default .venv-lock, which ignores itself in git).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ATLAS_LOCK_VENV:-.venv-lock}"
if [ "$venv" = ".venv" ] || [ "$venv" = "${ATLAS_VENV:-.venv}" ]; then
  echo "ATLAS_LOCK_VENV must not be the working venv ($venv)" >&2
  exit 1
fi
candidate="$venv/constraints.candidate.txt"
trap 'echo "lock.sh failed: constraints.txt unchanged; kept for a look: $venv (candidate lock: $candidate)" >&2' ERR
rm -rf "$venv"
ATLAS_VENV="$venv" ATLAS_CONSTRAINTS=none bash scripts/install.sh
# pip freeze --exclude-editable: every installed distribution but the project itself (and, as pip
# does, pip; setuptools/wheel too before Python 3.12), `name==version`, local labels cut.
"$venv/bin/pip" freeze --exclude-editable | sed -E 's/^([^=[:space:]]+==[^+[:space:]]+)\+[^[:space:]]*$/\1/' > "$candidate"
if grep -nvE '^[A-Za-z0-9][A-Za-z0-9._-]*==[^+[:space:]]+$' "$candidate"; then
  echo "the lines above of $candidate are not plain name==version pins: no lock written" >&2
  exit 1
fi
# The suite on the lock venv, with the candidate as its constraints: install.sh installs the venv
# "from" the candidate (a no-op but the editable project: it checks that the stripped pins resolve
# to what is installed), and tests/test_lock.py compares the venv with the candidate. No lint: a newer
# ruff may format differently, and the lock is about packages (ruff is pinned like any other).
CI=true ATLAS_SKIP_LINT=1 ATLAS_VENV="$venv" ATLAS_CONSTRAINTS="$candidate" bash scripts/test.sh
cp "$candidate" constraints.txt.tmp
mv -f constraints.txt.tmp constraints.txt
rm -rf "$venv"
echo "constraints.txt: $(wc -l < constraints.txt) packages; .venv takes them at its next install.sh"
