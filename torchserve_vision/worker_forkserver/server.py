"""The fork server: import what every worker imports, then fork one child per request.

Run by a worker's stand-in (`client`: `--directory D --owner PID --key K`, while it holds the
key's lock), or by `torchserve-vision server` beside `torchserve --start` (`--owner-pid-file`:
TorchServe's pid file, so that the imports run while the frontend starts), in a session of its own
with its output in a log file next to its socket. It exits when the frontend exits. It stays
single-threaded in Python and computes nothing before forking: no OpenMP pool, no CUDA context
(refused if a preloaded module made one), so each child starts as a fresh interpreter that had run
the same imports would, with those imports' objects frozen out of its cycle collector (`preload`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import importlib
import logging
import os
import runpy
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from torchserve_vision.waiting import wait_until
from torchserve_vision.worker_forkserver import python_path_entries
from torchserve_vision.worker_forkserver.cgroups import join_cgroup_of
from torchserve_vision.worker_forkserver.channel import (
    DESCRIPTOR_COUNT,
    ForkServerFiles,
    receive,
    send,
    server_key,
)
from torchserve_vision.worker_forkserver.client import connect

# Third-party modules only: the archive's own code is imported by each child from its model
# directory. Any that is not installed is left out.
PRELOADED_MODULES = (
    "numpy", "PIL.Image", "torch", "torchvision", "torchvision.io", "torchvision.transforms.v2",
    "timm", "yaml",
    "ts.arg_parser", "ts.async_service", "ts.metrics.metric_cache_yaml_impl", "ts.model_loader",
    "ts.protocol.otf_message_handler", "ts.service", "ts.context",
)
REQUEST_TIMEOUT_S = 10.0
FRONTEND_CLASS = "org.pytorch.serve.ModelServer"   # on the frontend's java command line
OWNER_TIMEOUT_S = 60.0       # for `torchserve --start` to write its pid file
OWNER_POLL_S = 0.05


def preload() -> None:
    """Import PRELOADED_MODULES; SystemExit if that initialised CUDA (a forked child could not
    use it). Python's cycle collector is off while they load (its passes over their hundreds of
    thousands of objects cost about 0.5 s of a core per start), runs once at the end, and what
    is left is frozen (`gc.freeze`, as Python's documentation advises before forking): the
    children's collections never walk these objects, so they neither spend time on them nor
    write to the pages the children share with this process."""
    gc.disable()
    try:
        for name in PRELOADED_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:
                continue
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise SystemExit("a preloaded module initialised CUDA; workers must start plainly")


@dataclass
class ForkServer:
    listener: socket.socket
    owner: int                    # a pidfd of the frontend
    # the interpreter's own search path, without this process's PYTHONPATH and script entries
    base_path: list[str]
    children: dict[int, tuple[int, socket.socket]] = field(default_factory=dict)  # pidfd -> (pid, stand-in)

    def serve(self) -> None:
        while True:
            listener = self.listener.fileno()
            readable, _, _ = select.select([listener, self.owner, *self.children], [], [])
            if self.owner in readable:
                return
            for pidfd in [descriptor for descriptor in readable if descriptor in self.children]:
                self.report_exit(pidfd)
            if listener in readable:
                self.accept()

    def report_exit(self, pidfd: int) -> None:
        pid, stand_in = self.children.pop(pidfd)
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
        with contextlib.suppress(OSError):   # the stand-in is gone already: the child followed it
            send(stand_in, {"exit_code": os.waitstatus_to_exitcode(status)})
        stand_in.close()

    def accept(self) -> None:
        stand_in, _ = self.listener.accept()
        stand_in_pid, uid = peer_credentials(stand_in)
        if uid != os.getuid():                    # only this user's processes may start workers
            stand_in.close()
            return
        stand_in.settimeout(REQUEST_TIMEOUT_S)
        try:
            request, descriptors = receive(stand_in, DESCRIPTOR_COUNT)
        except (OSError, ValueError):
            stand_in.close()
            return
        if request is None or len(descriptors) != DESCRIPTOR_COUNT:
            for descriptor in descriptors:
                os.close(descriptor)
            stand_in.close()
            return
        self.fork(request, descriptors, stand_in, stand_in_pid)

    def fork(self, request: dict[str, Any], descriptors: list[int], stand_in: socket.socket,
             stand_in_pid: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            stand_in.close()
            self.close_inherited()
            # counted and limited with its frontend (a shared fork server was started beside another)
            join_cgroup_of(stand_in_pid)
            run_worker(request, descriptors, self.base_path)   # never returns
        for descriptor in descriptors:
            os.close(descriptor)
        try:
            send(stand_in, {"pid": pid})
        except OSError:
            os.kill(pid, signal.SIGKILL)          # the stand-in is gone: so is the worker
        self.children[os.pidfd_open(pid)] = (pid, stand_in)

    def close_inherited(self) -> None:
        """In a child: close what belongs to the server (its socket, the other children's)."""
        self.listener.close()
        os.close(self.owner)
        for pidfd, (_, stand_in) in self.children.items():
            os.close(pidfd)
            stand_in.close()


def follow_stand_in(pipe: int) -> None:
    """Die when the stand-in does: the pipe's write end is only the stand-in's, so reading it
    ends when that process ends (killed by TorchServe included)."""
    def watch() -> None:
        while os.read(pipe, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="stand-in", daemon=True).start()


def run_worker(request: dict[str, Any], descriptors: list[int], base_path: list[str]) -> None:
    """In the child: become the worker TorchServe asked for, run its script, exit with its code."""
    code = 1
    try:
        stdin, stdout, stderr, pipe = descriptors
        for target, descriptor in ((0, stdin), (1, stdout), (2, stderr)):
            os.dup2(descriptor, target)
            os.close(descriptor)
        follow_stand_in(pipe)
        for number in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["environment"])
        tempfile.tempdir = None      # found again from TMPDIR: the preload's was another instance's
        argv = list(request["argv"])
        sys.argv = argv
        sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])),
                       *python_path_entries(os.environ.get("PYTHONPATH", "")), *base_path]
        sys.path_importer_cache.clear()
        importlib.invalidate_caches()
        logging.root.handlers.clear()     # the worker's basicConfig is the one that counts
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit_request:
        code = exit_code_of(exit_request)
    except BaseException:  # noqa: BLE001 - reported as a plain worker's would be
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def exit_code_of(exit_request: SystemExit) -> int:
    if exit_request.code is None:
        return 0
    if isinstance(exit_request.code, int):
        return exit_request.code
    print(exit_request.code, file=sys.stderr)
    return 1


def peer_credentials(connection: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", credentials)
    return int(pid), int(uid)


def listen(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(64)
    return listener


def live_frontend_pid(pid_file: Path) -> int | None:
    """The pid `pid_file` names if that process is a TorchServe frontend, else None."""
    try:
        pid = int(pid_file.read_text().strip() or 0)
        return pid if pid and FRONTEND_CLASS in " ".join(psutil.Process(pid).cmdline()) else None
    except (OSError, ValueError, psutil.Error):
        return None


def frontend_pid_from(pid_file: Path, timeout_s: float) -> int | None:
    """The frontend's pid once `pid_file` (written by `torchserve --start`) names a live
    TorchServe frontend; None when none does within `timeout_s` (its start failed)."""
    try:
        wait_until(lambda: live_frontend_pid(pid_file) is not None, timeout_s,
                   f"a TorchServe frontend in {pid_file}", interval_s=OWNER_POLL_S)
    except TimeoutError:
        return None
    return live_frontend_pid(pid_file)


def start_listening(files: ForkServerFiles) -> socket.socket:
    preload()
    files.pid.write_text(str(os.getpid()))
    return listen(files.socket)     # accepting connections: ready


def main(arguments: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--directory", type=Path, required=True, help="where its files go")
    owner_given = parser.add_mutually_exclusive_group(required=True)
    owner_given.add_argument("--owner", type=int, help="the frontend's pid (started by a worker)")
    parser.add_argument("--key", help="with --owner: the key the worker computed (channel.server_key)")
    owner_given.add_argument("--owner-pid-file", type=Path,
                             help="TorchServe's pid file (started beside `torchserve --start`)")
    parser.add_argument("--pid-file", type=Path, help="this process's pid, until it ends")
    options = parser.parse_args(arguments)
    if options.pid_file:
        options.pid_file.write_text(str(os.getpid()))
    own_entries = {os.path.abspath(entry) for entry in python_path_entries(os.environ.get("PYTHONPATH", ""))}
    base_path = [entry for entry in sys.path[1:] if os.path.abspath(entry) not in own_entries]
    owner_pid = options.owner or frontend_pid_from(options.owner_pid_file, OWNER_TIMEOUT_S)
    files = None          # once this process listens: its socket and pid file, removed at the end
    code = 1
    try:
        if owner_pid is None:
            code = 0
            return
        owner = os.pidfd_open(owner_pid)
        key = options.key or server_key(sys.executable, os.environ, owner_pid)
        mine = ForkServerFiles(options.directory, key)
        if options.owner is not None:
            files = mine
            listener = start_listening(files)        # the worker that started it holds the lock
        else:
            with open(mine.lock, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)     # workers that come meanwhile wait for it
                if mine.socket.exists() and (running := connect(mine.socket)) is not None:
                    running.close()
                    code = 0
                    return                       # a worker started one first: its files
                files = mine
                listener = start_listening(files)
        with listener:
            ForkServer(listener, owner, base_path).serve()
        code = 0
    except BaseException:  # noqa: BLE001 - reported here: the exit below skips the usual report
        traceback.print_exc()
    finally:
        if files is not None:
            files.socket.unlink(missing_ok=True)
            files.pid.unlink(missing_ok=True)
        if options.pid_file:
            options.pid_file.unlink(missing_ok=True)
        # No pid file left: `server stop` no longer waits, so this process is gone at once
        # (an interpreter that imported torch takes a second or more to tear itself down).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
