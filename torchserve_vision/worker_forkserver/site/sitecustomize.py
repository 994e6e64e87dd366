"""Run by every Python that TorchServe's frontend starts (this directory is first on its
PYTHONPATH): a worker is handed to the fork server (torchserve_vision.worker_forkserver); any
other process, or a worker the fork server cannot take, goes on as usual. The `sitecustomize`
that this one hides (one later on sys.path) is run after it."""

import contextlib
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _hand_over_worker() -> None:
    from torchserve_vision.worker_forkserver import DIRECTORY_VARIABLE, WORKER_SCRIPT_SUFFIX

    directory = os.environ.get(DIRECTORY_VARIABLE)
    if not directory or not sys.argv or not sys.argv[0].endswith(WORKER_SCRIPT_SUFFIX):
        return
    from torchserve_vision.worker_forkserver.client import exit_like, serve_through_forkserver

    code = serve_through_forkserver(directory)
    if code is not None:
        exit_like(code)          # never returns: the worker ran in the fork server's child


def _run_hidden_sitecustomize() -> None:
    for entry in sys.path:
        if entry and os.path.abspath(entry) == _HERE:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_hidden_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


# A worker must start: plainly, when the fork server cannot help.
with contextlib.suppress(Exception):
    _hand_over_worker()
_run_hidden_sitecustomize()
