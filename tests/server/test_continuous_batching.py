"""Continuous batching on a real TorchServe in its asynchronous worker mode: the frontend hands
each request to the worker at once, the worker batches whatever has arrived. A lone request is
answered alone; concurrent ones share batches; a bad upload fails only itself; per-request
options hold; a full worker queue answers 503 at once; the v2 protocol and the describe job work."""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.images import CAT_LABELS, photo_bytes
from tests.server.http_client import BURST_REQUESTS, KEEP_BUSY, burst_with_one_bad_upload, concurrently
from tests.server.servers import started_server
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.lab.benchmark_images import benchmark_jpeg
from torchserve_vision.rollout import wait_for_workers
from torchserve_vision.server_process import TorchServeInstance, ping

pytestmark = pytest.mark.server
MODEL, VERSION = "efficientnet_lite0", "1.0-cb"
# Room for every request of the burst test (its slow PNGs and its burst) even while the worker
# has taken none of them into a batch yet: with 16, a burst that arrived before the worker took
# the PNGs had 2 of its requests refused 503 (a full queue, as it should be).
MAX_QUEUED = KEEP_BUSY + BURST_REQUESTS
# A version whose worker computes one request at a time and keeps one waiting: any three
# requests in the worker at once overflow it, whatever the machine's speed (with 16 waiting
# and batches of 8, 48 concurrent phone photos overflowed only when the worker was slower than
# their arrival).
SMALL_QUEUE_VERSION, SMALL_QUEUE = "1.0-cb1", 1
# The frontend's queue of these versions: TorchServe's default, over the archive's own, so that
# what fills up first is the handler's queue (what these tests are about).
FRONTEND_QUEUE = 100


@pytest.fixture(scope="module")
def continuous_server(model_store: Path, tmp_path_factory) -> Iterator[TorchServeInstance]:
    """Lite0 as shipped, copied with `continuous_batching` on (batches of up to 8 in the worker)
    and the frontend's queued batching off (TorchServe picks that aggregator before the
    asynchronous one), registered with batch size 1 and no frontend delay, on a server of its own."""
    store = tmp_path_factory.mktemp("continuous-store")
    shutil.copy(model_store / "efficientnet_lite0-1.0.mar", store)
    archive = archive_with_version(store, "efficientnet_lite0-1.0.mar", VERSION,
                                   handler_changes={"continuous_batching": {"max_queued": MAX_QUEUED,
                                                                          "max_batch_size": 8}},
                                   frontend_changes={"asyncCommunication": True,
                                                     "continuousBatching": False,
                                                     "jobQueueSize": FRONTEND_QUEUE})
    small_queue = archive_with_version(store, "efficientnet_lite0-1.0.mar", SMALL_QUEUE_VERSION,
                                       handler_changes={"continuous_batching": {
                                           "max_queued": SMALL_QUEUE, "max_batch_size": 1}},
                                       frontend_changes={"asyncCommunication": True,
                                                         "continuousBatching": False,
                                                         "jobQueueSize": FRONTEND_QUEUE})
    for server in started_server(tmp_path_factory.mktemp("continuous"), store, load_models=""):
        client = server.client(timeout_s=60)   # a register answers once the archive is read
        for name in (archive, small_queue):
            client.register(name, batch_size=1, max_batch_delay_ms=0, initial_workers=1,
                            response_timeout_s=60, startup_timeout_s=240)
        for version in (VERSION, SMALL_QUEUE_VERSION):
            wait_for_workers(client, MODEL, version, 1, 300)
        yield server


def post(server: TorchServeInstance, body: bytes, headers: dict[str, str] | None = None,
         version: str | None = None) -> requests.Response:
    path = f"{MODEL}/{version}" if version else MODEL
    return requests.post(f"{server.inference_url}/predictions/{path}", data=body, timeout=60,
                         headers={"Content-Type": "application/octet-stream", **(headers or {})})


def test_a_lone_request_is_answered_alone(continuous_server):
    answer = post(continuous_server, photo_bytes("chelsea.png"))
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Batch-Size"] == "1"
    assert answer.json()[0]["label"] in CAT_LABELS and len(answer.json()) == 5


def test_concurrent_requests_share_batches_and_a_bad_upload_fails_only_itself(continuous_server):
    """Sent while slow PNGs keep the worker busy, the burst queues behind them and shares
    batches; each gets its own answer and options; a bad upload among them fails alone."""
    replies = burst_with_one_bad_upload(lambda body, headers: post(continuous_server, body, headers),
                                        benchmark_jpeg("phone"))
    assert max(int(a.headers["X-Batch-Size"]) for a in replies) > 1


def test_a_full_worker_queue_answers_503_at_once_and_the_rest_are_served(continuous_server):
    photo = benchmark_jpeg("phone")
    answers = concurrently([lambda: post(continuous_server, photo, version=SMALL_QUEUE_VERSION)] * 48, 48)
    statuses = [a.status_code for a in answers]
    refused = [a for a in answers if a.status_code == 503]
    assert set(statuses) <= {200, 503} and refused and statuses.count(200) >= SMALL_QUEUE + 1, statuses
    assert all(a.headers.get("Retry-After") == "1" and a.json()["type"] == "ServiceUnavailable"
               for a in refused)
    assert all(a.json()[0]["label"] in CAT_LABELS for a in answers if a.status_code == 200)
    assert post(continuous_server, photo_bytes("chelsea.png"), version=SMALL_QUEUE_VERSION).status_code == 200
    assert ping(continuous_server)


def test_the_open_inference_protocol_and_the_describe_job_work(continuous_server):
    request = {"id": "7", "parameters": {"top_k": 2},
               "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                           "data": [base64.b64encode(photo_bytes("chelsea.png")).decode()]}]}
    answer = requests.post(f"{continuous_server.inference_url}/v2/models/{MODEL}/infer",
                           json=request, timeout=60)
    assert answer.status_code == 200, answer.text
    outputs = {output["name"]: output for output in answer.json()["outputs"]}
    assert answer.json()["id"] == "7" and outputs["labels"]["shape"] == [1, 2]
    assert outputs["labels"]["data"][0] in CAT_LABELS
    (described,) = continuous_server.client().describe(MODEL, VERSION, customized=True)
    assert described["customizedMetadata"]["max_batch_size"] == 8
