"""What the stand-in and the fork server say to each other, and where their files lie.

One Unix SOCK_SEQPACKET connection per worker: the stand-in sends one request (JSON: argv, cwd,
environment) with four descriptors (its standard input, output and error, and the read end of a
pipe only it writes to); the server answers {"pid": N} once the child is forked, then
{"exit_code": C} when the child has exited (C as `os.waitstatus_to_exitcode`: negative for a
signal). Message boundaries are the socket's own."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchserve_vision.worker_forkserver import DIRECTORY_VARIABLE

MAX_MESSAGE_BYTES = 1 << 20
DESCRIPTOR_COUNT = 4   # stdin, stdout, stderr, the stand-in's pipe
# What TorchServe's frontend adds to a worker's environment (PYTHONPATH with the model's
# directory; its backend settings, TS_DECODE_INPUT_REQUEST, TS_IPEX_ENABLE, ...): not in the fork
# server's key, so that one started beside the frontend serves its workers. Each child gets the
# worker's own environment; no module the server preloads reads these at import.
FRONTEND_ADDED_PREFIX = "TS_"
FRONTEND_ADDED_VARIABLES = frozenset({"PYTHONPATH"})
# Where each frontend keeps its own files (server_process.TorchServeInstance.environment): not in
# the key either, so that the frontends of one owner (OWNER_VARIABLE) share a fork server. Each
# child gets its worker's values; what the preloaded modules kept of them (`tempfile`'s directory)
# the child forgets (server.run_worker). TSV_TRAFFIC_DIR is handlers.shadow.shadow_policy's
# TRAFFIC_DIR_ENVIRONMENT, which this package cannot import; tests/unit/test_worker_forkserver.py
# checks the set against two instances' environments.
INSTANCE_VARIABLES = frozenset({"TMPDIR", "TEMP", "LOG_LOCATION", "METRICS_LOCATION", "TSV_TRAFFIC_DIR",
                                DIRECTORY_VARIABLE})
# Set by pytest for each test it runs (so different for each server a test session starts); no
# preloaded module reads it.
RUNNER_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


@dataclass(frozen=True)
class ForkServerFiles:
    """The files of one fork server: socket, lock (held while one is started), pid, log, and a
    marker left when it could not start (later workers start plainly instead of waiting)."""

    directory: Path
    key: str

    def _file(self, suffix: str) -> Path:
        return self.directory / f".fork.{self.key}{suffix}"

    @property
    def socket(self) -> Path:
        return self._file("")

    @property
    def lock(self) -> Path:
        return self._file(".lock")

    @property
    def pid(self) -> Path:
        return self._file(".pid")

    @property
    def log(self) -> Path:
        return self._file(".log")

    @property
    def failed(self) -> Path:
        return self._file(".failed")


def server_key(executable: str, environment: Mapping[str, str], owner_pid: int) -> str:
    """Which fork server may fork a worker: one started by the same interpreter, with the same
    environment (but what the frontend adds and where its instance keeps its files), for the same
    owner (`owner_pid`: the frontend, or the process that owns a shared fork server)."""
    shared = sorted((name, value) for name, value in environment.items()
                    if name not in FRONTEND_ADDED_VARIABLES | INSTANCE_VARIABLES | RUNNER_VARIABLES
                    and not name.startswith(FRONTEND_ADDED_PREFIX))
    text = json.dumps([executable, owner_pid, shared])
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def send(connection: socket.socket, message: Mapping[str, Any], descriptors: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a fork-server message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    socket.send_fds(connection, [data], list(descriptors))


def receive(connection: socket.socket, descriptor_count: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """(message, descriptors); (None, []) when the other side has closed the connection."""
    data, descriptors, _flags, _address = socket.recv_fds(connection, MAX_MESSAGE_BYTES, descriptor_count)
    if not data:
        for descriptor in descriptors:
            os.close(descriptor)
        return None, []
    return json.loads(data), descriptors
