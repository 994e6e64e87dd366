"""The rollout modules' server (one per module, v1 loaded; each module's `archives` fixture
builds the versions it rolls out: versions.built_rollout_archives) and its client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.rollouts.versions import MODEL
from tests.server.servers import started_server
from torchserve_vision.client import TorchServeClient
from torchserve_vision.rollout import unregister_retrying, wait_for_workers
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.server_state import versions_of


@pytest.fixture(scope="module")
def rollout_server(model_store: Path, archives: dict[str, str],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServeInstance]:
    yield from started_server(tmp_path_factory.mktemp("rollouts"), model_store,
                              load_models="efficientnet_lite0-1.0.mar")


@pytest.fixture
def client(rollout_server: TorchServeInstance, model_store: Path) -> TorchServeClient:
    """A client for a server where v1 is the only version of the model, and the default."""
    client = TorchServeClient(rollout_server.management_url, rollout_server.inference_url)
    versions = {v["modelVersion"] for v in versions_of(client, MODEL)}
    if "1.0" not in versions:
        client.register("efficientnet_lite0-1.0.mar", 8, 20, 1, 60)
        wait_for_workers(client, MODEL, "1.0", 1, 60)
    client.set_default(MODEL, "1.0")
    for version in versions - {"1.0"}:
        unregister_retrying(client, MODEL, version)
    return client
