"""The stand-in's side: find (or start) this frontend's fork server, hand it the worker, and
wait for the worker's exit. Imports nothing heavy: it runs in every worker process TorchServe
starts, before that process would have imported anything."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

from torchserve_vision.waiting import wait_until
from torchserve_vision.worker_forkserver import FRONTEND_PID_VARIABLE, python_path_entries, shared_owner
from torchserve_vision.worker_forkserver.channel import ForkServerFiles, receive, send, server_key

SERVER_MODULE = "torchserve_vision.worker_forkserver.server"
START_TIMEOUT_S = 120.0      # TorchServe waits two minutes for a worker to say it started
POLL_INTERVAL_S = 0.05


def connect(path: Path) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(str(path))
    except OSError:
        connection.close()
        return None
    return connection


def server_environment(environment: dict[str, str], model_dir: str) -> dict[str, str]:
    """The worker's environment without the model's directory (or one under it) on PYTHONPATH
    (the server imports no archive code)."""
    def in_model_dir(entry: str) -> bool:
        return os.path.commonpath([os.path.abspath(entry), model_dir]) == model_dir
    entries = [entry for entry in python_path_entries(environment.get("PYTHONPATH", ""))
               if not in_model_dir(entry)]
    return {**environment, "PYTHONPATH": os.pathsep.join(entries)}


def spawn_server(arguments: list[str], environment: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`python -m SERVER_MODULE arguments...` in a session of its own, its output in `log`, in
    the directory of its files (which outlives the model directory a worker starts it from)."""
    with open(log, "ab") as output:
        return subprocess.Popen([sys.executable, "-m", SERVER_MODULE, *arguments], env=environment,
                                cwd=log.parent, stdin=subprocess.DEVNULL, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)


class ServerExited(Exception):
    """The fork server being waited for exited before it accepted connections."""


def start_server(files: ForkServerFiles, owner_pid: int) -> socket.socket | None:
    """Start the fork server and wait until it accepts connections; None (and the failure
    marker) when it exits first or takes longer than START_TIMEOUT_S."""
    process = spawn_server(["--directory", str(files.directory), "--owner", str(owner_pid),
                            "--key", files.key],
                           server_environment(dict(os.environ), os.path.abspath(os.getcwd())), files.log)
    connected: list[socket.socket] = []

    def accepting() -> bool:
        if process.poll() is not None:
            raise ServerExited
        connection = connect(files.socket) if files.socket.exists() else None
        if connection is not None:
            connected.append(connection)
        return connection is not None

    try:
        wait_until(accepting, START_TIMEOUT_S, "the fork server", interval_s=POLL_INTERVAL_S)
        return connected[0]
    except (ServerExited, TimeoutError):
        pass
    if process.poll() is None:
        process.kill()
    files.failed.write_text(f"the fork server did not start (exit code {process.poll()}); see {files.log}\n")
    return None


def connect_or_start(files: ForkServerFiles, owner_pid: int) -> socket.socket | None:
    connection = connect(files.socket)
    if connection is not None or files.failed.exists():
        return connection
    with open(files.lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # one worker starts the server; the others wait
        connection = connect(files.socket)
        if connection is not None or files.failed.exists():
            return connection
        return start_server(files, owner_pid)


def wait_for_exit(connection: socket.socket, pid: int) -> int:
    """The worker's exit code from the server; if the server went away first, wait for the
    worker itself (its code is then unknown: 1)."""
    message, _ = receive(connection)
    if message is not None:
        return int(message["exit_code"])
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return 1
    select.select([pidfd], [], [])
    return 1


def exit_like(code: int) -> None:
    """Exit as the worker did: with its code, or killed by the same signal."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def serve_through_forkserver(directory: str) -> int | None:
    """Hand this process's worker (argv, cwd, environment, standard streams) to the fork server
    and return the worker's exit code once it has exited; None before anything was handed over
    (then this process starts the worker itself)."""
    frontend_pid = os.getppid()
    owner_pid = shared_owner(os.environ) or frontend_pid
    files = ForkServerFiles(Path(directory), server_key(sys.executable, os.environ, owner_pid))
    try:
        connection = connect_or_start(files, owner_pid)
    except OSError:
        return None
    if connection is None:
        return None
    with connection:
        pipe_read, _pipe_write = os.pipe()    # the write end stays here until this process ends
        environment = {**os.environ, FRONTEND_PID_VARIABLE: str(frontend_pid)}
        request = {"argv": sys.argv, "cwd": os.getcwd(), "environment": environment}
        try:
            send(connection, request, (0, 1, 2, pipe_read))
        except OSError:
            return None
        # Handed over: from here on this process never starts the worker itself (a child may
        # be running), whatever happens; it only waits for it.
        try:
            os.close(pipe_read)
            signal.signal(signal.SIGINT, signal.SIG_DFL)   # interrupted, this ends: so does the worker
            reply, _ = receive(connection)
            return 1 if reply is None else wait_for_exit(connection, int(reply["pid"]))
        except BaseException:  # noqa: BLE001 - never fall through to a second start
            return 1
