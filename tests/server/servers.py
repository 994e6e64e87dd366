"""Starting a real TorchServe (Java frontend + Python workers) for a test, on free 127.0.0.1 ports.

Its configuration is a project config (default config/config.properties) with only the
addresses, ports and model store changed, so the tests exercise the configuration users start from.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from torchserve_vision import paths
from torchserve_vision.server_process import (
    TorchServeInstance,
    instance_for,
    request_stop,
    start,
    wait_for_exit,
)
from torchserve_vision.torchserve_config import server_config
from torchserve_vision.worker_forkserver.frontend_setup import wait_for_fork_servers

STOP_TIMEOUT_S = 60.0
# Servers asked to stop whose frontend may still be exiting (about 2 s of idle network threads
# each, after every connection is closed and every worker told to stop): awaited, and killed if
# they outlive STOP_TIMEOUT_S, once the session's tests are done (wait_for_stopping_servers), so
# that the next module need not wait for them. Each ran on ports of its own.
stopping: list[tuple[int | None, Path]] = []


def started_server(run_dir: Path, model_store: Path, base_config: Path = paths.DEVELOPMENT_CONFIG,
                   **overrides: str) -> Iterator[TorchServeInstance]:
    """A started server for a fixture to yield; asked to stop afterwards, also when a test
    failed (its exit awaited at the end of the session)."""
    instance = instance_for(server_config(run_dir, model_store, base_config, **overrides), run_dir)
    try:
        start(instance, model_store, timeout_s=240)
        yield instance
    finally:
        stopping.append((request_stop(instance, STOP_TIMEOUT_S), instance.tmp_dir))


def wait_for_stopping_servers() -> None:
    """Every server started_server asked to stop has exited, with its fork servers."""
    while stopping:
        pid, tmp_dir = stopping.pop()
        if pid is not None:
            wait_for_exit(pid, STOP_TIMEOUT_S)
        wait_for_fork_servers(tmp_dir, STOP_TIMEOUT_S)
