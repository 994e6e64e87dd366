"""torchserve_vision.v2_model_endpoints with a fake management client (the real path through
HAProxy and TorchServe: tests/server/test_v2_front.py); and the front's HAProxy configuration,
checked by HAProxy itself."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from torchserve_vision.client import ManagementError
from torchserve_vision.front_proxy import (
    ADMIN_SOCKET,
    REQUEST_LOG_SOCKET,
    SOCKET_PATH_MAX,
    front_config,
    haproxy_binary,
    prepare_traffic_dir,
    traffic_socket,
)
from torchserve_vision.v2_model_endpoints import V2ModelEndpoints, is_model_endpoint

DECLARED = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "labels", "datatype": "BYTES", "shape": [-1, -1]}]}


class FakeManagement:
    """Model "m": versions 1.0 (default, one READY worker) and 2.0 (its worker still loading)."""

    def __init__(self) -> None:
        self.customized_calls = 0

    def describe(self, model: str, version: str | None = "all",
                 customized: bool = False) -> list[dict[str, Any]]:
        versions = {"1.0": "READY", "2.0": "UNLOADING"}
        if model != "m" or (version not in (None, "all") and version not in versions):
            raise ManagementError(404, "not found", "GET /models")
        chosen = list(versions) if version == "all" else [version or "1.0"]
        described: list[dict[str, Any]] = [{"modelVersion": v, "workers": [{"status": versions[v]}]}
                                           for v in chosen]
        if customized:
            self.customized_calls += 1
            described[0]["customizedMetadata"] = {"device": "cpu", "v2": DECLARED}
        return described


@pytest.fixture
def management() -> FakeManagement:
    return FakeManagement()


def endpoints(management: FakeManagement, key: dict[str, str] | None = None) -> V2ModelEndpoints:
    return V2ModelEndpoints(client=lambda: management, required_headers=lambda: key or {})  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize(("path", "status"), [
    ("/v2/models/m/ready", 200), ("/v2/models/m/versions/1.0/ready", 200),
    ("/v2/models/m/versions/2.0/ready", 400),           # registered, no READY worker
    ("/v2/models/m/versions/9.9/ready", 404), ("/v2/models/other/ready", 404)])
def test_readiness_is_a_200_only_with_a_ready_worker(management, path, status):
    assert endpoints(management).answer(path, {})[0] == status


def test_metadata_is_the_handlers_declaration_asked_once_per_version(management):
    served = endpoints(management)
    for _ in range(3):
        status, body = served.answer("/v2/models/m", {})
        assert status == 200
        assert body == {"name": "m", "versions": ["1.0", "2.0"], "platform": "pytorch_torchserve",
                        **DECLARED}
    assert management.customized_calls == 1
    assert served.answer("/v2/models/m/versions/2.0", {})[0] == 200
    assert management.customized_calls == 2
    status, body = served.answer("/v2/models/other", {})
    assert status == 404 and "other is not registered" in body["error"]


def test_with_token_authorization_the_inference_key_is_asked_for(management):
    served = endpoints(management, {"Authorization": "Bearer k1"})
    assert served.answer("/v2/models/m/ready", {})[0] == 401
    assert served.answer("/v2/models/m", {"Authorization": "Bearer k2"})[0] == 401
    assert served.answer("/v2/models/m/ready", {"Authorization": "Bearer k1"})[0] == 200
    # as HAProxy sends it
    assert served.answer("/v2/models/m/ready", {"authorization": "Bearer k1"})[0] == 200


@pytest.mark.parametrize(("path", "ours"), [
    ("/v2/models/m", True), ("/v2/models/m/ready", True), ("/v2/models/m/versions/1.0", True),
    ("/v2/models/m/versions/1.0/ready", True), ("/v2/models/m?x=1", True),
    ("/v2/models/m/infer", False), ("/v2/health/ready", False), ("/v2", False),
    ("/predictions/m", False), ("/v2/models/m/versions/1.0/infer", False)])
def test_only_the_model_endpoints_are_routed_to_them(path, ours):
    assert is_model_endpoint(path) is ours


@pytest.mark.parametrize(("with_canary", "depth"), [(False, ""), (True, ""), (True, "d" * 90)])
def test_haproxy_accepts_the_front_configuration(tmp_path, with_canary, depth):
    """With the canary's sockets too, also from a run directory too deep for HAProxy's socket
    paths: those sockets then live in a short directory that the traffic directory names."""
    config = tmp_path / "haproxy.cfg"
    traffic_dir = tmp_path / depth / "traffic" if with_canary else None
    if traffic_dir is not None:
        prepare_traffic_dir(traffic_dir)
    config.write_text(front_config("127.0.0.1", 8000, "http://127.0.0.1:8080", 8090, 600,
                                   traffic_dir))
    checked = subprocess.run([haproxy_binary(), "-c", "-f", str(config)], capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    if traffic_dir is not None:
        for name in (ADMIN_SOCKET, REQUEST_LOG_SOCKET):
            path = traffic_socket(traffic_dir, name)
            assert str(path) in config.read_text() and len(str(path)) <= SOCKET_PATH_MAX
            assert path == traffic_socket(traffic_dir, name)          # found again the same way
            assert path.parent != traffic_dir or not depth             # moved when too deep
