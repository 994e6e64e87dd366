#!/usr/bin/env bash
# The whole check: set up what is needed, lint, type-check, run every test (real TorchServe included).
# Arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow and not server"` (the fast tier).
# Tests run in TSV_TEST_PROCESSES processes (default 4 on any machine: most of a server test's
# time is spent waiting for workers, load and time windows, not computing; docs/testing.md),
# each module in one of them, the longest first (tests/conftest.py); `-n 0` runs them in one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/torchserve-vision build --check-config
.venv/bin/python -m pytest -n "${TSV_TEST_PROCESSES:-4}" --dist loadfile --no-loadscope-reorder "$@"
