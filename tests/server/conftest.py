"""The session's real TorchServe, shared by the server tests (see tests/server/servers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.servers import started_server
from torchserve_vision.server_process import TorchServeInstance


@pytest.fixture(scope="session")
def server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServeInstance]:
    yield from started_server(tmp_path_factory.mktemp("torchserve"), model_store)
