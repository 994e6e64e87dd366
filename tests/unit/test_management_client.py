from __future__ import annotations

import http.server
import json
import random
import socket
import threading
import zipfile
from typing import ClassVar

import pytest

from torchserve_vision import client as management_client
from torchserve_vision.archives.versions import (
    archive_manifest,
    archive_with_version,
    settings_version,
)
from torchserve_vision.client import KeyFile, ManagementError, TorchServeClient
from torchserve_vision.model_descriptions import ServingSettings


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_connection_errors_are_retried_a_bounded_number_of_times(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(management_client.time, "sleep", pauses.append)
    client = TorchServeClient(f"http://127.0.0.1:{closed_port()}", attempts=3)
    with pytest.raises(ManagementError) as caught:
        client.list_models()
    assert caught.value.status == 0 and "cannot reach" in caught.value.message
    assert pauses == [0.5, 1.0]  # three attempts, backing off


def test_dry_run_prints_changing_calls_without_sending(capsys):
    client = TorchServeClient(f"http://127.0.0.1:{closed_port()}", dry_run=True)
    client.scale("m", "1.0", 2, 3)
    assert capsys.readouterr().out.strip() == (
        f"[dry-run] PUT {client.management_url}/models/m/1.0?min_worker=2&max_worker=3&synchronous=false")


def test_key_file_expiry_reads_torchserves_nanosecond_timestamps(tmp_path):
    path = tmp_path / "key_file.json"
    path.write_text(json.dumps({
        "management": {"key": "a", "expiration time": "2000-01-01T00:00:00.123456789Z"},
        "inference": {"key": "b", "expiration time": "2999-01-01T00:00:00.123456789Z"},
        "API": {"key": "c"}}))
    keys = KeyFile(path)
    assert keys.expired("management") and not keys.expired("inference")
    assert keys.key("API") == "c"


def test_a_key_refresh_from_a_management_port_not_yet_bound_is_not_healthy(tmp_path):
    """A starting frontend writes its key file before it binds the management port: a ping whose
    key must be refreshed then is "not healthy yet" (False), not a connection error that ends
    the wait for the server (seen in a fresh-clone run: the production-config server's start)."""
    path = tmp_path / "key_file.json"
    path.write_text(json.dumps({
        "management": {"key": "a", "expiration time": "2000-01-01T00:00:00.123456789Z"},
        "inference": {"key": "b", "expiration time": "2000-01-01T00:00:00.123456789Z"},
        "API": {"key": "c"}}))
    client = TorchServeClient(f"http://127.0.0.1:{closed_port()}", f"http://127.0.0.1:{closed_port()}",
                              key_file=KeyFile(path), attempts=1)
    assert client.ping() is False
    with pytest.raises(ManagementError) as caught:
        client.refresh_key("inference")
    assert caught.value.status == 0 and "cannot reach" in caught.value.message


def test_environment_supplies_addresses_and_key_file(monkeypatch, tmp_path):
    monkeypatch.setenv("TS_MANAGEMENT_URL", "http://127.0.0.1:9991/")
    monkeypatch.setenv("TS_KEY_FILE", str(tmp_path / "k.json"))
    client = TorchServeClient.from_environment()
    assert client.management_url == "http://127.0.0.1:9991"
    assert client.key_file is not None and client.key_file.path == tmp_path / "k.json"
    assert TorchServeClient.from_environment("http://127.0.0.1:1").management_url == "http://127.0.0.1:1"


def test_settings_version_replaces_an_earlier_suffix():
    delayed = ServingSettings(16, 5, 1, 1, 60, batching="delayed")
    assert settings_version("1.0", delayed) == "1.0-bs16-d5"
    assert settings_version("1.0-bs8-d20", delayed) == "1.0-bs16-d5"
    queued = ServingSettings(16, 0, 1, 1, 60, batching="queued")
    assert settings_version("1.0-bs8-d20", queued) == "1.0-bs16-q"
    assert settings_version("1.0-bs16-q", delayed) == "1.0-bs16-d5"
    with_deadline = ServingSettings(16, 0, 1, 1, 60, batching="queued", deadline_ms=800)
    assert settings_version("1.0-bs16-q", with_deadline) == "1.0-bs16-q-t800"
    assert settings_version("1.0-bs16-q-t800", queued) == "1.0-bs16-q"


def test_archive_with_version_rewrites_only_the_manifest_version(tmp_path):
    source = tmp_path / "m-1.0.mar"
    with zipfile.ZipFile(source, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "m",
                                                                        "modelVersion": "1.0"}}))
        archive.writestr("model.pt", b"weights")
    name = archive_with_version(tmp_path, source.name, "1.0-bs4-d5")
    assert name == "m-1.0-bs4-d5.mar"
    assert archive_manifest(tmp_path / name) == {"modelName": "m", "modelVersion": "1.0-bs4-d5"}
    with zipfile.ZipFile(tmp_path / name) as archive:
        assert archive.read("model.pt") == b"weights"
    assert archive_manifest(source)["modelVersion"] == "1.0"


def test_a_versioned_copy_deflates_text_and_stores_what_deflates_poorly(tmp_path):
    """Weights deflate little, so the copy stores them (not deflated again); text stays deflated;
    every file reads back the same."""
    source = tmp_path / "m-1.0.mar"
    noise = random.Random(0).randbytes(200_000)              # as weights are: barely compressible
    text = b"handler:\n  top_k: 5\n" * 5_000
    with zipfile.ZipFile(source, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "m",
                                                                        "modelVersion": "1.0"}}))
        archive.writestr("model.pt", noise)
        archive.writestr("labels.txt", text)
    once = archive_with_version(tmp_path, source.name, "2.0")
    twice = archive_with_version(tmp_path, once, "3.0")             # a copy of a copy
    for name, version in ((once, "2.0"), (twice, "3.0")):
        with zipfile.ZipFile(tmp_path / name) as copy:
            assert copy.getinfo("model.pt").compress_type == zipfile.ZIP_STORED
            assert copy.getinfo("labels.txt").compress_type == zipfile.ZIP_DEFLATED
            assert (copy.read("model.pt"), copy.read("labels.txt")) == (noise, text)
        assert archive_manifest(tmp_path / name)["modelVersion"] == version


class FlakyUnregister(TorchServeClient):
    """A client whose management API answers DELETE with the given statuses, then succeeds."""

    def __init__(self, statuses: list[int]) -> None:
        super().__init__(unregister_retry_s=0.0)
        self.statuses, self.calls = list(statuses), 0

    def call(self, method: str, path: str, params: dict | None = None, kind: str = "management",
             **kwargs: object) -> dict[str, str]:
        assert (method, path) == ("DELETE", "/models/m/2.0")
        self.calls += 1
        if self.statuses:
            raise ManagementError(self.statuses.pop(0), "ConcurrentModificationException",
                                  f"{method} {path}")
        return {"status": 'Model "m" version: 2.0 unregistered'}


def test_unregister_retries_a_server_error_but_not_a_client_error():
    flaky = FlakyUnregister([500, 500])
    answer = flaky.unregister("m", "2.0")
    assert flaky.calls == 3
    assert answer == {"status": 'Model "m" version: 2.0 unregistered'}
    refused = FlakyUnregister([404])
    with pytest.raises(ManagementError, match="-> 404"):
        refused.unregister("m", "2.0")
    assert refused.calls == 1
    always = FlakyUnregister([500] * 10)
    with pytest.raises(ManagementError, match="-> 500"):
        always.unregister("m", "2.0")
    assert always.calls == always.unregister_attempts == 5


def test_environment_supplies_the_metrics_address(monkeypatch):
    monkeypatch.setenv("TS_METRICS_URL", "http://127.0.0.1:9992/")
    assert TorchServeClient.from_environment().metrics_url == "http://127.0.0.1:9992"
    monkeypatch.delenv("TS_METRICS_URL")
    assert TorchServeClient.from_environment().metrics_url == management_client.DEFAULT_METRICS_URL
    assert TorchServeClient().metrics_url is None      # built in code: read only when given


class Exposition(http.server.BaseHTTPRequestHandler):
    """A metrics address answering with the frontend agent's gauge (two hosts' series of one
    version, one of another) and what it was asked for."""
    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        Exposition.asked.append(self.path)
        body = (b"# HELP ts_requests_in_batch Requests workers have taken\n"
                b"# TYPE ts_requests_in_batch gauge\n"
                b'ts_requests_in_batch{model_name="m",model_version="1.0",hostname="a",} 2.0\n'
                b'ts_requests_in_batch{model_name="m",model_version="1.0",hostname="b",} 1.0\n'
                b'ts_requests_in_batch{model_name="m",model_version="2.0",hostname="a",} 0.0\n'
                b'ts_queue_latency_microseconds{model_name="m",model_version="1.0",} 7.0\n')
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_requests_in_batch_are_read_per_version_from_the_metrics_address():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()  # quick shutdown
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        counts = TorchServeClient(metrics_url=url).requests_in_batch()
    finally:
        server.shutdown()
    assert counts == {("m", "1.0"): 3, ("m", "2.0"): 0}
    assert Exposition.asked == ["/metrics?name%5B%5D=ts_requests_in_batch"]
    assert TorchServeClient(metrics_url=f"http://127.0.0.1:{closed_port()}",
                            timeout_s=2).requests_in_batch() is None
    assert TorchServeClient().requests_in_batch() is None


class DescribingClient(TorchServeClient):
    """A client whose management API describes one version (`continuousBatching` as given) and
    whose metrics address reads `in_batch` (None: unreadable); it records the calls."""

    def __init__(self, continuous: bool, in_batch: dict[tuple[str, str], int] | None,
                 worker: str = "READY") -> None:
        super().__init__()
        self.continuous, self.in_batch, self.worker = continuous, in_batch, worker
        self.calls: list[tuple[str, str, dict | None]] = []

    def call(self, method: str, path: str, params: dict | None = None, kind: str = "management",
             **kwargs: object) -> list[dict[str, object]]:
        self.calls.append((method, path, params))
        described: dict[str, object] = {"modelName": "m", "modelVersion": "1.0",
                                        "continuousBatching": self.continuous,
                                        "workers": [{"id": "9000", "status": self.worker}]}
        if params == {"customized": "true"}:
            described["customizedMetadata"] = {"device": "cpu"}
        return [described]

    def requests_in_batch(self) -> dict[tuple[str, str], int] | None:
        return self.in_batch


@pytest.mark.parametrize(("continuous", "in_batch", "asked"), [
    (True, {("m", "2.0"): 0}, False),        # queued, and the agent's series lacks this version
    (True, {("m", "1.0"): 0}, True),         # queued, gathered by the agent
    (True, None, True),                      # the metrics cannot be read: asked as before
    (False, {}, True),                       # TorchServe's own batch aggregator takes describe
])
def test_a_customized_describe_is_sent_only_where_torchserve_would_not_repeat_it_forever(
        continuous, in_batch, asked):
    client = DescribingClient(continuous, in_batch)
    if asked:
        assert client.describe("m", "1.0", customized=True)[0]["customizedMetadata"] == {"device": "cpu"}
    else:
        with pytest.raises(ManagementError, match="without the frontend agent") as refused:
            client.describe("m", "1.0", customized=True)
        assert refused.value.status == 0
    customized = [call for call in client.calls if call[2] == {"customized": "true"}]
    assert len(customized) == (1 if asked else 0)
    assert client.batched_by_agent("m", "1.0") is (None if in_batch is None else ("m", "1.0") in in_batch)


def test_a_version_without_a_ready_worker_is_not_said_to_lack_the_agent():
    """Just registered (its worker starting): the agent's series of it is not there yet, which
    says nothing of the agent; the plain description is given, nothing asked of the workers."""
    client = DescribingClient(True, {("other", "1.0"): 0}, worker="UNLOADING")
    assert client.batched_by_agent("m", "1.0") is None
    assert "customizedMetadata" not in client.describe("m", "1.0", customized=True)[0]
    assert [call for call in client.calls if call[2] == {"customized": "true"}] == []
    from torchserve_vision.cli.models_common import describe_lines

    described = client.describe("m", "1.0")[0] | {"modelUrl": "m.mar", "batchSize": 4, "maxBatchDelay": 50,
                                                  "minWorkers": 1, "maxWorkers": 1, "responseTimeout": 120}
    assert "without the agent" not in "\n".join(describe_lines(described, {("other", "1.0"): 0}))
    described["workers"] = [{"id": "9000", "status": "READY"}]
    assert "without the agent" in "\n".join(describe_lines(described, {("other", "1.0"): 0}))
