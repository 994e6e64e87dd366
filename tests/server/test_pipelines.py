"""Pipeline archives on a real TorchServe: the confidence cascade (real Lite0 -> Lite2) and
detect-then-classify (SSDlite -> Lite0), registered on the session's server through the
management API like any model, driven with concurrent requests so that they share batches."""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.answers import assert_same_answer, served_classifier_precision
from tests.archives import archive_context, load_classifier
from tests.detections import assert_same_detections, rows_from_answer
from tests.images import CAT_LABELS, photo_bytes
from tests.server.http_client import concurrently, session
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.rollout import wait_for_workers
from torchserve_vision.server_process import TorchServeInstance

pytestmark = pytest.mark.server
PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]
CASCADE, PIPELINE = "efficientnet_cascade", "detect_classify"
SETTINGS = {CASCADE: ServingSettings(batch_size=8, max_batch_delay_ms=50, min_workers=1),
            PIPELINE: ServingSettings(batch_size=4, max_batch_delay_ms=50, min_workers=1)}


@pytest.fixture(scope="module")
def pipelines(server: TorchServeInstance) -> Iterator[TorchServeInstance]:
    """Both pipelines registered on the shared server (one worker each; a long batch delay so that
    concurrent requests share batches), unregistered afterwards. TorchServe answers a register
    call once it has read the archive: with two classifiers or a detector inside, that took over
    the default 5 s on 2 busy cores."""
    client = server.client(timeout_s=120)
    for name, settings in SETTINGS.items():
        client.register(f"{name}-1.0.mar", settings.batch_size, settings.max_batch_delay_ms,
                        settings.min_workers, settings.response_timeout_s)
    try:
        for name in SETTINGS:
            wait_for_workers(client, name, "1.0", 1, 180)
        yield server
    finally:
        for name in SETTINGS:
            client.unregister(name, "1.0")


@pytest.fixture(scope="module")
def lite2(model_store: Path, tmp_path_factory: pytest.TempPathFactory):
    """The cascade's second stage, its own archive loaded in-process."""
    return load_classifier(model_store / "efficientnet_lite2-1.0.mar", tmp_path_factory.mktemp("lite2"))


def post(server: TorchServeInstance, model: str, image: bytes, **fields: Any) -> requests.Response:
    url = f"{server.inference_url}/predictions/{model}"
    if not fields:
        return session().post(url, data=image, timeout=120)
    return session().post(url, json={"data": base64.b64encode(image).decode(), **fields}, timeout=120)


def in_process(handler, image: bytes) -> list[dict[str, Any]]:
    (body,) = handler.handle([{"body": bytearray(image)}],
                             archive_context(handler.model_dir, request_headers=[{}]))
    return json.loads(body)


def test_the_cascade_answers_each_request_with_the_model_its_options_ask_for(pipelines, lite2):
    server = pipelines
    precision = served_classifier_precision()
    calls = [functools.partial(post, server, CASCADE, photo_bytes(name), escalation=mode)
             for name in PHOTOS for mode in ("never", "always")]
    calls.append(functools.partial(post, server, CASCADE, b"corrupt upload"))
    replies = concurrently(calls, clients=len(calls))
    assert max(int(reply.headers["X-Batch-Size"]) for reply in replies) > 1  # batches were shared
    assert replies[-1].status_code == 400 and replies[-1].json()["type"] == "NotAnImage"
    for position, name in enumerate(PHOTOS):
        kept, escalated = replies[2 * position], replies[2 * position + 1]
        assert kept.status_code == escalated.status_code == 200
        assert kept.headers["X-Answered-By"] == "efficientnet_lite0-1.0"
        assert escalated.headers["X-Answered-By"] == "efficientnet_lite2-1.0"
        alone = post(server, "efficientnet_lite0", photo_bytes(name)).json()
        assert_same_answer(kept.json(), alone, precision)
        assert_same_answer(escalated.json(), in_process(lite2, photo_bytes(name)), precision,
                           lite2.precision)
        assert {a["model"] for a in escalated.json()} == {"efficientnet_lite2-1.0"}


def test_auto_escalation_follows_the_first_models_confidence(pipelines):
    server = pipelines
    first = {name: post(server, CASCADE, photo_bytes(name), escalation="never").json()[0]["probability"]
             for name in PHOTOS}
    threshold = sorted(first.values())[2]
    replies = concurrently([functools.partial(post, server, CASCADE, photo_bytes(name),
                                              escalation_threshold=threshold) for name in PHOTOS], 5)
    for name, reply in zip(PHOTOS, replies, strict=True):
        expected = "efficientnet_lite2-1.0" if first[name] < threshold else "efficientnet_lite0-1.0"
        assert reply.headers["X-Answered-By"] == expected, name
    assert post(server, CASCADE, photo_bytes("chelsea.png")).json()[0]["label"] in CAT_LABELS
    bad = post(server, CASCADE, photo_bytes("coffee.png"), escalation="sometimes")
    assert bad.status_code == 400 and "escalation" in bad.json()["message"]


def test_escalations_reach_prometheus(pipelines):
    server = pipelines
    post(server, CASCADE, photo_bytes("coffee.png"), escalation="always")
    text = requests.get(f"{server.metrics_url}/metrics", timeout=30).text
    escalated = re.findall(r'^HandlerEscalatedRequests\{.*ModelName="efficientnet_cascade".*\} (\S+)$',
                           text, re.M)
    rates = re.findall(r'^HandlerEscalationRate\{.*ModelName="efficientnet_cascade".*\} (\S+)$',
                       text, re.M)
    assert escalated and float(escalated[0]) >= 1
    assert rates and 0 <= float(rates[0]) <= 1


def test_detect_then_classify_adds_a_classification_to_the_detectors_boxes(pipelines):
    server = pipelines
    options = {"score_threshold": 0.05, "max_boxes": 3}
    calls = [functools.partial(post, server, PIPELINE, photo_bytes(name), **options) for name in PHOTOS]
    calls.append(functools.partial(post, server, PIPELINE, photo_bytes("coffee.png"), max_boxes=0))
    replies = concurrently(calls, clients=len(calls))
    assert max(int(reply.headers["X-Batch-Size"]) for reply in replies) > 1
    assert replies[-1].status_code == 400
    for name, reply in zip(PHOTOS, replies[:-1], strict=True):
        assert reply.status_code == 200
        detector = post(server, "ssd_mobilenet_v2", photo_bytes(name), score_threshold=0.05).json()
        answer = reply.json()
        assert_same_detections(answer, rows_from_answer(detector))
        classified = [d["classification"] for d in answer if d["classification"] is not None]
        assert len(classified) == min(3, len(answer))
        assert all(len(scores) == 3 for scores in classified)  # the archive's top_k
    none = post(server, PIPELINE, photo_bytes("rocket.jpg"), score_threshold=1.0)
    assert none.status_code == 200 and none.json() == []
