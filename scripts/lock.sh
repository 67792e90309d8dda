#!/usr/bin/env bash
# Refresh constraints.txt: a fresh .venv with the newest versions pyproject.toml allows, the whole
# test suite on it, and only if it passes, the exact versions it passed with (temp file + rename).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv
ATLAS_CONSTRAINTS=none bash scripts/install.sh
bash scripts/test.sh
.venv/bin/pip freeze --exclude-editable > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
# The next install.sh (constrained) sees a new stamp and checks that the lock installs as recorded.
echo "constraints.txt: $(wc -l < constraints.txt) packages"
