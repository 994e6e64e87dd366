#!/usr/bin/env bash
# The whole check: set up what is needed, lint, type-check, run every test (real TorchServe included).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python scripts/build_archives.py --check-config
.venv/bin/python -m pytest "$@"
