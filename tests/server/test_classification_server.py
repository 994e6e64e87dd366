"""The default classifier archive served by a real TorchServe, over real HTTP."""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable

import pytest
import requests

from tests.answers import assert_same_answer as assert_answers_match
from tests.answers import served_classifier_precision
from tests.images import CAT_LABELS, encode, photo_bytes, png_declaring_size, textured_rgb
from tests.server.http_client import Reply, concurrently, post_image
from tests.server.logs import log_lines, wait_for_log
from torchserve_vision import paths
from torchserve_vision.model_descriptions import ServingSettings, load_descriptions
from torchserve_vision.server_process import TorchServeInstance, ping

pytestmark = pytest.mark.server
PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]


def url(server: TorchServeInstance, model: str = "efficientnet_lite0") -> str:
    return f"{server.inference_url}/predictions/{model}"


@pytest.fixture(scope="module")
def solo_answers(server) -> dict[str, list[dict]]:
    """Each photo's answer when sent alone, one request at a time."""
    answers = {}
    for name in PHOTOS:
        reply = post_image(url(server), photo_bytes(name))
        assert reply.status == 200 and reply.batch_size == 1
        answers[name] = reply.body
    return answers


def assert_same_answer(served: list[dict], alone: list[dict]) -> None:
    """Batched vs alone on the same server (bf16 results depend a little on the batch size)."""
    assert_answers_match(served, alone, served_classifier_precision())


def test_chelsea_is_a_cat_and_every_photo_gets_its_own_answer(solo_answers):
    assert solo_answers["chelsea.png"][0]["label"] in CAT_LABELS
    assert solo_answers["coffee.png"][0]["label"] == "espresso"
    assert len({answer[0]["index"] for answer in solo_answers.values()}) == len(PHOTOS)


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, solo_answers):
    names = PHOTOS * 8
    calls = [functools.partial(post_image, url(server), photo_bytes(n)) for n in names]
    replies = concurrently(calls, clients=16)
    assert all(reply.status == 200 for reply in replies)
    for name, reply in zip(names, replies, strict=True):
        assert_same_answer(reply.body, solo_answers[name])
    sizes = [reply.batch_size or 0 for reply in replies]
    assert max(sizes) > 1, f"no batch formed: {sizes}"


def test_a_bad_input_in_a_batch_gets_its_4xx_and_its_batch_mates_their_answers(server,
                                                                             solo_answers):
    bad = {b"not an image at all": 400, b"\xff\xd8\xff\xe0" + b"\x00" * 100: 400,
           png_declaring_size(9000, 9000): 413}
    payloads: list[tuple[bytes, str | None]] = []
    for round_index in range(6):
        for photo in PHOTOS[:3]:
            payloads.append((photo_bytes(photo), photo))
        payloads.append((list(bad)[round_index % len(bad)], None))
    calls = [functools.partial(post_image, url(server), data) for data, _ in payloads]
    replies = concurrently(calls, clients=12)
    mixed_batch_seen = False
    for (data, name), reply in zip(payloads, replies, strict=True):
        if name is None:
            assert reply.status == bad[data]
            assert reply.body["code"] == bad[data] and reply.body["message"]
            mixed_batch_seen |= (reply.batch_size or 0) > 1
        else:
            assert reply.status == 200
            assert_same_answer(reply.body, solo_answers[name])
    assert mixed_batch_seen, "no bad request shared a batch with others"
    assert ping(server)


def test_raw_multipart_and_json_base64_bodies_give_the_same_answer(server, solo_answers):
    image = photo_bytes("coffee.png")
    multipart = requests.post(url(server), files={"data": ("coffee.png", image)}, timeout=60)
    as_json = requests.post(url(server), timeout=60,
                            json={"data": base64.b64encode(image).decode()})
    raw_put = requests.put(url(server), data=image, timeout=60)  # as `curl -T` sends it
    for answer in (multipart, as_json, raw_put):
        assert answer.status_code == 200, answer.text
        assert_same_answer(answer.json(), solo_answers["coffee.png"])


def test_other_formats_and_modes_are_classified(server):
    image = textured_rgb(120, 160, seed=5)
    for data in (encode(image, "WEBP"), encode(image.convert("L"), "BMP"),
                 encode(image.convert("CMYK"), "JPEG"), encode(image.convert("P"), "GIF"),
                 encode(image, "TIFF")):
        reply = post_image(url(server), data)
        assert reply.status == 200 and len(reply.body) == 5


@pytest.mark.parametrize(("payload", "status", "error_type"), [
    (b"", 400, "EmptyBody"),
    (b"hello, world", 400, "NotAnImage"),
    (png_declaring_size(20000, 20000), 413, "ImageTooLarge"),
])
def test_bad_inputs_alone_get_json_errors(server, payload, status, error_type):
    reply = post_image(url(server), payload)
    assert (reply.status, reply.body["type"]) == (status, error_type)


def test_a_body_over_max_request_size_gets_413_from_the_frontend(server):
    reply = requests.post(url(server), data=b"\xff" * 7_000_000, timeout=60,
                          headers={"Content-Type": "application/octet-stream"})
    assert reply.status_code == 413
    assert ping(server)


def test_unknown_model_is_404(server):
    reply = requests.post(url(server, "no_such_model"), data=b"x", timeout=30,
                          headers={"Content-Type": "image/jpeg"})
    assert reply.status_code == 404


def test_batch_settings_come_from_config_properties(server):
    described = requests.get(f"{server.management_url}/models/efficientnet_lite0",
                             timeout=30).json()[0]
    serving = {d.name: d.serving for d in load_descriptions(paths.MODEL_DESCRIPTIONS)}["efficientnet_lite0"]
    settings = ServingSettings.of_version(described)
    assert (settings.batch_size, settings.max_batch_delay_ms, settings.batching) == (
        serving.batch_size, serving.max_batch_delay_ms, serving.batching)
    assert described["minWorkers"] == serving.min_workers
    assert [w["status"] for w in described["workers"]] == ["READY"] * serving.min_workers


def test_replies_carry_the_batch_size_they_were_served_in(server):
    reply: Reply = post_image(url(server), photo_bytes("rocket.jpg"))
    assert reply.batch_size == 1


def test_logs_are_written_once_at_info_through_the_project_log_config(server):
    assert server.log_config is not None and server.log_config.name == "log4j2.xml"
    reply = post_image(url(server), photo_bytes("coffee.png"))
    assert reply.status == 200
    def has(text: str) -> Callable[[list[str]], bool]:
        return lambda lines: any(text in line for line in lines)

    model_log = wait_for_log(server.log_dir / "model_log.log", has('"model": "efficientnet_lite0"'))
    assert any("batch {" in line and "efficientnet_lite0" in line for line in model_log)
    access_log = wait_for_log(server.log_dir / "access_log.log", has("/predictions/efficientnet_lite0"))
    assert any("/predictions/efficientnet_lite0" in line for line in access_log)
    ts_log = log_lines(server.log_dir / "ts_log.log")
    assert any("Inference API bind to" in line for line in ts_log)
    assert not [line for line in ts_log if "[DEBUG]" in line]
    # TorchServe's built-in configuration writes each event twice and copies worker output here.
    # The events of the server's start happen once (other lines may repeat: a stack trace's
    # frames, warnings of the suite's bad requests within one millisecond).
    for event in ("Initializing plugins manager", "Inference API bind to", "Management API bind to",
                  "Metrics API bind to"):
        assert len([line for line in ts_log if event in line]) == 1, event
    assert not [line for line in ts_log if "MODEL_LOG" in line]
