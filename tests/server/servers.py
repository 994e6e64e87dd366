"""Starting a real TorchServe (Java frontend + Python workers) for a test, on free 127.0.0.1 ports.

Its configuration is a project config (default config/config.properties) with only the
addresses, ports and model store changed, so the tests exercise the configuration users start from.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from torchserve_vision import paths
from torchserve_vision.deployment_settings import AS_WRITTEN, DeploymentSettings
from torchserve_vision.server_process import TorchServeInstance, instance_for, start, stop
from torchserve_vision.torchserve_config import server_config
from torchserve_vision.worker_forkserver import OWNER_VARIABLE


def started_server(run_dir: Path, model_store: Path, base_config: Path = paths.DEVELOPMENT_CONFIG,
                   settings: DeploymentSettings = AS_WRITTEN,
                   **overrides: str) -> Generator[TorchServeInstance, None, None]:
    """A started server for a fixture to yield; stopped afterwards, also when a test failed.
    `settings` as a deployment's environment would give them (e.g. workers per model)."""
    instance = instance_for(server_config(run_dir, model_store, base_config, **overrides), run_dir,
                            settings=settings)
    try:
        start(instance, model_store, timeout_s=240)
        yield instance
    finally:
        stop(instance)


@contextmanager
def fork_server_of_its_own() -> Iterator[None]:
    """Servers started within start their fork server beside their frontend, as outside the
    tests (tests/conftest.py's `one_fork_server_per_process` shares one otherwise)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(OWNER_VARIABLE, raising=False)
        yield
