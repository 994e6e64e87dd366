"""Worker starts without the imports: a fork server per frontend that has imported torch,
torchvision and TorchServe's worker modules once, and forks each new worker from there.

TorchServe starts every worker as `python ts/model_service_worker.py ...`, and most of a worker's
start is that interpreter importing torch and torchvision (and torchvision importing
`torch._dynamo`): seconds of CPU per worker, paid again on every scale-up, rollout and crash
recovery. `torchserve-vision server` puts `site/` on the frontend's PYTHONPATH and names a
directory in TSV_WORKER_FORKSERVER_DIR; its `sitecustomize` (run by every Python the frontend starts)
hands a worker's command line, environment, working directory and standard streams to the fork
server (`client`), which forks a child that runs TorchServe's worker script as `__main__`
(`server`). The process TorchServe started stays as a thin stand-in: it exits with the child's
status, and the child dies when it does (TorchServe's kill reaches it).

A worker always starts: plainly when no directory is set or its fork server cannot start
(its log and a `.fork.<key>.failed` marker say why); one that went away is started again. The
archive's own code (the handlers) is never preloaded: each child imports it from its model
directory, as a plain worker does. `TSV_WORKER_FORKSERVER=0` in the environment of
`torchserve-vision server` turns it off.

A process that starts several frontends on one host (a test session, a supervisor of
side-by-side versions) may own one fork server for all of them: with its pid in
TSV_WORKER_FORKSERVER_OWNER and a directory in TSV_WORKER_FORKSERVER_DIR, the frontends started
from its environment hand their workers to one fork server there (one per environment, as the key
in `channel` says), which exits when that process does; no frontend start imports torch again.
"""

import os
from collections.abc import Mapping

DIRECTORY_VARIABLE = "TSV_WORKER_FORKSERVER_DIR"
SWITCH_VARIABLE = "TSV_WORKER_FORKSERVER"
OWNER_VARIABLE = "TSV_WORKER_FORKSERVER_OWNER"
# Set in each forked worker's environment to the frontend's pid (the worker's parent is the fork
# server): handlers.torchserve_context.FRONTEND_PID_VARIABLE, which this package cannot import.
FRONTEND_PID_VARIABLE = "TSV_FRONTEND_PID"
# The script TorchServe 0.12 runs for every Python worker (WorkerLifeCycle.startWorkerPython).
WORKER_SCRIPT_SUFFIX = "/ts/model_service_worker.py"


def python_path_entries(value: str) -> list[str]:
    """The entries of a PYTHONPATH value, empty ones left out."""
    return [entry for entry in value.split(os.pathsep) if entry]


def shared_owner(environment: Mapping[str, str]) -> int | None:
    """The pid of the process that owns a fork server shared by its frontends (OWNER_VARIABLE,
    with DIRECTORY_VARIABLE naming where it lives), or None: each frontend owns its own."""
    value = environment.get(OWNER_VARIABLE, "")
    if not value.isdigit() or int(value) <= 0 or not environment.get(DIRECTORY_VARIABLE):
        return None
    return int(value)
