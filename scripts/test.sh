#!/usr/bin/env bash
# The whole check: set up what is needed, lint, type-check, run every test (real TorchServe included).
# Arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -m "not slow"` (the fast tier).
# The tests run in two processes (pytest-xdist; a module's tests stay in one, with its servers;
# the modules are handed out in tests/conftest.py's order, the longest first);
# `-n 0` after them runs everything in this one (docs/testing.md). A worker process that crashes
# (a native abort) fails its test and ends the run: pytest-xdist 3.8's replacement worker under
# loadfile can wait forever for work (pytest-xdist issues 784, 1323, 1378).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# malloc asks for transparent huge pages for its large chunks (glibc 2.35 and later; nothing where
# the kernel's THP mode is `always` or `never`): the test model store's build took 11-12 % less
# time and 7-11 % fewer core-seconds with it (docs/testing.md, "Huge pages for malloc"). A value
# already given wins (GLIBC_TUNABLES=glibc.malloc.hugetlb=0 compares a run without it).
case "${GLIBC_TUNABLES:-}" in
  *glibc.malloc.hugetlb=*) ;;
  *) export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1" ;;
esac
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/torchserve-vision build --check-config
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart 0 "$@"
