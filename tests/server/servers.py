"""Starting a real TorchServe (Java frontend + Python workers) for a test, on free 127.0.0.1 ports.

Its configuration is a project config (default config/config.properties) with only the
addresses, ports and model store changed, so the tests exercise the configuration users start from.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from torchserve_vision import paths
from torchserve_vision.deployment_settings import AS_WRITTEN, DeploymentSettings
from torchserve_vision.server_process import TorchServeInstance, instance_for, start, stop
from torchserve_vision.torchserve_config import server_config


def started_server(run_dir: Path, model_store: Path, base_config: Path = paths.DEVELOPMENT_CONFIG,
                   settings: DeploymentSettings = AS_WRITTEN,
                   **overrides: str) -> Iterator[TorchServeInstance]:
    """A started server for a fixture to yield; stopped afterwards, also when a test failed.
    `settings` as a deployment's environment would give them (e.g. workers per model)."""
    instance = instance_for(server_config(run_dir, model_store, base_config, **overrides), run_dir,
                            settings=settings)
    try:
        start(instance, model_store, timeout_s=240)
        yield instance
    finally:
        stop(instance)
