"""Queued batching (the frontend agent's, torchserve_vision/frontend) on a real TorchServe: a
worker takes what is queued when it is free and never waits for company. A lone request runs at
once even with an hour of batch delay registered; requests that queue behind a busy worker share
its next batch; a bad upload fails only itself; TorchServe's describe job travels alone; scaling
and unregistering work; an archive without it keeps TorchServe's own batching on the same server."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from tests.images import CAT_LABELS, photo_bytes
from tests.server.http_client import burst_with_one_bad_upload, concurrently
from tests.server.servers import started_server
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.lab.benchmark_images import benchmark_jpeg
from torchserve_vision.rollout import wait_for_workers
from torchserve_vision.server_process import TorchServeInstance, ping

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"
QUEUED, DELAYED = "1.0-queued", "1.0-delayed"
AN_HOUR_MS = 3_600_000


@pytest.fixture(scope="module")
def queued_server(model_store: Path, tmp_path_factory) -> Iterator[TorchServeInstance]:
    """Lite0 twice on a server of its own, one worker each, batch size 8 and an hour of batch
    delay: version 1.0-queued with queued batching, 1.0-delayed with TorchServe's."""
    store = tmp_path_factory.mktemp("queued-store")
    shutil.copy(model_store / f"{MODEL}-1.0.mar", store)
    archives = {version: archive_with_version(store, f"{MODEL}-1.0.mar", version,
                                              frontend_changes={"continuousBatching": queued})
                for version, queued in ((QUEUED, True), (DELAYED, False))}
    for server in started_server(tmp_path_factory.mktemp("queued"), store, load_models=""):
        client = server.client()
        for version, archive in archives.items():
            client.register(archive, batch_size=8, max_batch_delay_ms=AN_HOUR_MS, initial_workers=1,
                            response_timeout_s=120, startup_timeout_s=240)
            wait_for_workers(client, MODEL, version, 1, 300)
        client.set_default(MODEL, QUEUED)
        yield server


def post(server: TorchServeInstance, body: bytes, version: str = QUEUED,
         headers: dict[str, str] | None = None, timeout_s: float = 60) -> requests.Response:
    return requests.post(f"{server.inference_url}/predictions/{MODEL}/{version}", data=body,
                         timeout=timeout_s,
                         headers={"Content-Type": "application/octet-stream", **(headers or {})})


def test_the_frontend_runs_the_agents_batching_for_the_archive_that_asks_for_it(queued_server):
    described = {v["modelVersion"]: v for v in queued_server.client().describe(MODEL, "all")}
    assert described[QUEUED]["continuousBatching"] is True
    assert described[DELAYED]["continuousBatching"] is False
    assert "-javaagent:" in queued_server.effective_config.read_text()
    log = (queued_server.log_dir / "ts_log.log").read_text(errors="replace")
    assert f"queued batching for {MODEL} (batch size 8)" in log


def test_a_lone_request_runs_at_once_whatever_the_batch_delay(queued_server):
    """With TorchServe's batching the same request would wait the hour for company."""
    answer = post(queued_server, photo_bytes("chelsea.png"), timeout_s=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Batch-Size"] == "1"
    assert answer.json()[0]["label"] in CAT_LABELS
    with pytest.raises(requests.Timeout):
        post(queued_server, photo_bytes("chelsea.png"), version=DELAYED, timeout_s=5)


def test_requests_queued_behind_a_busy_worker_share_its_next_batch(queued_server):
    """12 MP photos: each batch takes long enough that the requests behind it queue. Each gets
    its own answer and options; a bad upload among them fails alone."""
    replies = burst_with_one_bad_upload(lambda body, headers: post(queued_server, body, headers=headers),
                                        benchmark_jpeg("phone"))
    batch_sizes = [int(a.headers["X-Batch-Size"]) for a in replies]
    assert max(batch_sizes) > 1 and max(batch_sizes) <= 8


def test_the_describe_job_travels_alone_between_predictions(queued_server):
    """TorchServe's describe job (`?customized=true`) queued among predictions: answered once,
    alone, and the predictions around it each get theirs."""
    photo = benchmark_jpeg("phone")
    client = queued_server.client()
    described: list[dict] = []

    def describe() -> int:
        described.extend(client.describe(MODEL, QUEUED, customized=True))
        return 200

    calls: list[Callable[[], int]] = [lambda: post(queued_server, photo).status_code] * 6
    calls.insert(3, describe)
    assert concurrently(calls, len(calls)) == [200] * 7
    assert described[0]["customizedMetadata"]["v2"]["inputs"][0]["name"] == "image"
    assert post(queued_server, photo_bytes("coffee.png")).json()[0]["label"] == "espresso"


def test_scaling_and_unregistering_work(queued_server, model_store: Path):
    client = queued_server.client()
    client.scale(MODEL, QUEUED, 2, 2)
    wait_for_workers(client, MODEL, QUEUED, 2, 300)
    answers = concurrently([lambda: post(queued_server, photo_bytes("chelsea.png"))] * 8, 8)
    assert [a.status_code for a in answers] == [200] * 8
    client.scale(MODEL, QUEUED, 1, 1)
    wait_for_workers(client, MODEL, QUEUED, 1, 300)
    client.set_default(MODEL, DELAYED)
    client.unregister(MODEL, QUEUED)
    assert [v["modelVersion"] for v in client.describe(MODEL, "all")] == [DELAYED]
    assert ping(queued_server)
