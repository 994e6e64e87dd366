"""The worker processes a TorchServe frontend started, found after the frontend has gone.

TorchServe 0.12 kills its workers asynchronously at a stop: the shutdown hook interrupts each
worker's thread, and that thread's `finally` kills the worker's process
(WorkerLifeCycle.exit). The JVM can exit before a thread gets there, and a frontend that
crashes or is killed never gets there. An idle worker then ends by itself (its socket closes), but
one that is busy (loading a model for minutes, or in a long batch) keeps running, with its memory
and device, until that work ends. A stand-in of a forked worker
(torchserve_vision.worker_forkserver) waits for its child, so it stays as well.

Every worker of an instance is started as `python .../ts/model_service_worker.py --sock-name
<TMPDIR>/.ts.sock.<port> ...` with the instance's own TMPDIR, so its command line names it
whoever its parent is now. Killing a stand-in ends its forked child too (the child follows it).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import psutil

from torchserve_vision.worker_forkserver import WORKER_SCRIPT_SUFFIX

SOCKET_PREFIX = ".ts.sock."


def is_worker_of(command_line: list[str], tmp_dir: Path) -> bool:
    """Whether `command_line` is a TorchServe worker's (or its stand-in's) whose socket lies in
    `tmp_dir`, the TMPDIR of one instance."""
    if not any(part.endswith(WORKER_SCRIPT_SUFFIX) for part in command_line):
        return False
    sockets = [value for flag, value in itertools.pairwise(command_line) if flag == "--sock-name"]
    return any(Path(socket).parent == tmp_dir and Path(socket).name.startswith(SOCKET_PREFIX)
               for socket in sockets)


def workers_of(tmp_dir: Path) -> list[psutil.Process]:
    """The running worker processes (plain workers, or the stand-ins of forked ones) whose
    sockets lie in `tmp_dir`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if is_worker_of(process.info["cmdline"] or [], tmp_dir):
            found.append(process)
    return found


def end_leftover_workers(tmp_dir: Path, timeout_s: float = 10.0) -> None:
    """Kill the workers of the instance whose TMPDIR is `tmp_dir` that outlived its frontend, as
    the frontend itself would have, and wait for them."""
    leftovers = workers_of(tmp_dir.resolve())
    for process in leftovers:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(leftovers, timeout=timeout_s)
