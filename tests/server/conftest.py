"""A real TorchServe (Java frontend + Python workers) on free 127.0.0.1 ports, shared per session.

Its configuration is the project's config/config.properties with only the addresses, ports and
model store changed, so the tests exercise the configuration users start from.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.build_archives import DEFAULT_CONFIG
from scripts.torchserve_config import read_properties, render_properties
from scripts.torchserve_process import TorchServeInstance, instance_for, start, stop


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def server_config(directory: Path, model_store: Path, base_config: Path = DEFAULT_CONFIG,
                  **overrides: str) -> Path:
    """`base_config` (default config/config.properties) on free ports, loading from `model_store`."""
    inference, management, metrics, grpc_inference, grpc_management = free_ports(5)
    properties = read_properties(base_config)
    properties.update({
        "inference_address": f"http://127.0.0.1:{inference}",
        "management_address": f"http://127.0.0.1:{management}",
        "metrics_address": f"http://127.0.0.1:{metrics}",
        "grpc_inference_port": str(grpc_inference),
        "grpc_management_port": str(grpc_management),
        # Worker sockets are .ts.sock.<port> files; keep them apart from other instances.
        "initial_worker_port": str(20000 + inference % 20000),
        "model_store": str(model_store),
    })
    properties.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.properties"
    path.write_text(render_properties(properties))
    return path


def started_server(run_dir: Path, model_store: Path, base_config: Path = DEFAULT_CONFIG,
                   **overrides: str) -> Iterator[TorchServeInstance]:
    instance = instance_for(server_config(run_dir, model_store, base_config, **overrides), run_dir)
    try:
        start(instance, model_store, timeout_s=240)
        yield instance
    finally:
        stop(instance)


@pytest.fixture(scope="session")
def server(model_store: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[TorchServeInstance]:
    yield from started_server(tmp_path_factory.mktemp("torchserve"), model_store)
