"""What `torchserve-vision server` does for the fork server: the frontend's environment, and
waiting for the fork servers to end after the frontend has."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil

from torchserve_vision.worker_forkserver import (
    DIRECTORY_VARIABLE,
    OWNER_VARIABLE,
    SWITCH_VARIABLE,
    python_path_entries,
    shared_owner,
)
from torchserve_vision.worker_forkserver.client import SERVER_MODULE, spawn_server

SITE_DIR = Path(__file__).resolve().parent / "site"


def enabled(environment: dict[str, str]) -> bool:
    return environment.get(SWITCH_VARIABLE, "1") != "0"


def with_fork_server(environment: dict[str, str], directory: Path) -> dict[str, str]:
    """`environment` for a frontend whose workers start from a fork server keeping its files in
    `directory`, or in the shared one the environment names (`shared_owner`); unchanged when
    SWITCH_VARIABLE is 0."""
    if not enabled(environment):
        return environment
    entries = [str(SITE_DIR), *python_path_entries(environment.get("PYTHONPATH", ""))]
    where = environment[DIRECTORY_VARIABLE] if shared_owner(environment) else str(directory)
    return {**environment, DIRECTORY_VARIABLE: where, "PYTHONPATH": os.pathsep.join(entries)}


PRESTARTED_PID_FILE, PRESTARTED_LOG_FILE = ".fork.prestarted.pid", ".fork.prestarted.log"


def prestart_fork_server(environment: dict[str, str],
                         frontend_pid_file: Path) -> subprocess.Popen[bytes] | None:
    """Start the fork server beside the frontend (`environment` as `with_fork_server` made it), so
    that its imports run while the frontend starts: it waits for `frontend_pid_file`, then for
    the first worker. None when the fork server is off, or shared (its first worker starts it;
    later frontends find it running)."""
    directory = environment.get(DIRECTORY_VARIABLE)
    if not enabled(environment) or not directory or shared_owner(environment):
        return None
    return spawn_server(["--directory", directory, "--owner-pid-file", str(frontend_pid_file),
                         "--pid-file", str(Path(directory) / PRESTARTED_PID_FILE)],
                        environment, Path(directory) / PRESTARTED_LOG_FILE)


def without_fork_server(environment: dict[str, str]) -> dict[str, str]:
    """`environment` as it was before `with_fork_server` (for a frontend started plainly)."""
    entries = [entry for entry in python_path_entries(environment.get("PYTHONPATH", ""))
               if entry != str(SITE_DIR)]
    plain = {name: value for name, value in environment.items()
             if name not in (DIRECTORY_VARIABLE, OWNER_VARIABLE)}
    if entries:
        return {**plain, "PYTHONPATH": os.pathsep.join(entries)}
    plain.pop("PYTHONPATH", None)
    return plain


def fork_server_pids(directory: Path) -> list[int]:
    pids = []
    for pid_file in directory.glob(".fork.*.pid"):
        try:
            pids.append(int(pid_file.read_text().strip()))
        except (OSError, ValueError):
            continue
    return pids


def wait_for_fork_servers(directory: Path, timeout_s: float) -> None:
    """Each fork server exits once its frontend has: wait for that, and kill one that is still
    there after `timeout_s`."""
    processes = []
    for pid in set(fork_server_pids(directory)):
        try:
            process = psutil.Process(pid)
            if SERVER_MODULE in process.cmdline():     # not another process that got a dead one's pid
                processes.append(process)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for process in alive:
        process.kill()
