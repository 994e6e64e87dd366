"""The default detection archive served by a real TorchServe, beside the classifier."""

from __future__ import annotations

import functools
import io

import pytest
import requests
from PIL import Image

from tests.detections import assert_same_detections, rows_from_answer
from tests.images import encode, photo_bytes
from tests.server.http_client import assert_burst_answers_each_as_alone, concurrently, post_image
from torchserve_vision.server_process import TorchServeInstance, ping

pytestmark = pytest.mark.server


def url(server: TorchServeInstance) -> str:
    return f"{server.inference_url}/predictions/ssd_mobilenet_v2"


def resized(name: str, scale: float) -> bytes:
    image = Image.open(io.BytesIO(photo_bytes(name))).convert("RGB")
    return encode(image.resize((int(image.width * scale), int(image.height * scale))), "JPEG", quality=92)


# Five photos at several sizes and aspect ratios.
IMAGES = {
    "astronaut": photo_bytes("astronaut.png"),
    "rocket": photo_bytes("rocket.jpg"),
    "coffee_small": resized("coffee.png", 0.5),
    "motorcycle_big": resized("motorcycle_left.png", 1.7),
    "chelsea_portrait": encode(Image.open(io.BytesIO(photo_bytes("chelsea.png"))).rotate(90, expand=True),
                               "PNG"),
}
LOW = {"X-Score-Threshold": "0.05", "X-Max-Detections": "100"}  # enough detections to compare


def detect(server: TorchServeInstance, image: bytes,
           headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(url(server), data=image, timeout=120,
                           headers={"Content-Type": "application/octet-stream", **(headers or {})})


@pytest.fixture(scope="module")
def solo(server) -> dict[str, list[dict]]:
    answers = {}
    for name, image in IMAGES.items():
        answer = detect(server, image, LOW)
        assert answer.status_code == 200 and answer.headers["X-Batch-Size"] == "1"
        answers[name] = answer.json()
        assert answers[name], f"no detections on {name} even at 0.05"
    return answers


def test_boxes_are_in_original_pixels_and_answers_differ_per_image(solo):
    sizes = {name: Image.open(io.BytesIO(image)).size for name, image in IMAGES.items()}
    for name, answer in solo.items():
        width, height = sizes[name]
        for detection in answer:
            x1, y1, x2, y2 = detection["box"]
            assert 0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height
            assert set(detection) == {"label", "index", "score", "box"}
    assert len({tuple(d["score"] for d in answer[:3]) for answer in solo.values()}) == len(IMAGES)


def test_mixed_sizes_batch_together_and_each_answer_equals_its_solo_answer(server, solo):
    names = list(IMAGES) * 4
    calls = [functools.partial(detect, server, IMAGES[name], LOW) for name in names]
    answers = concurrently(calls, clients=8)
    batch_sizes = []
    for name, answer in zip(names, answers, strict=True):
        assert answer.status_code == 200
        assert_same_detections(answer.json(), rows_from_answer(solo[name]), box_px=0.5, score=1e-4)
        batch_sizes.append(int(answer.headers["X-Batch-Size"]))
    assert max(batch_sizes) > 1, batch_sizes


def test_bad_inputs_in_a_batch_fail_alone(server, solo):
    payloads = []
    for _ in range(4):
        payloads += [(IMAGES["astronaut"], LOW, 200), (IMAGES["rocket"], LOW, 200),
                     (b"GIF89a-but-not-really", LOW, 400),
                     (IMAGES["coffee_small"], {"X-Score-Threshold": "7"}, 400)]
    calls = [functools.partial(detect, server, data, headers) for data, headers, _ in payloads]
    answers = concurrently(calls, clients=8)
    shared = False
    for (data, _, status), answer in zip(payloads, answers, strict=True):
        assert answer.status_code == status, answer.text
        if status == 200:
            name = "astronaut" if data == IMAGES["astronaut"] else "rocket"
            assert_same_detections(answer.json(), rows_from_answer(solo[name]), box_px=0.5)
        else:
            assert answer.json()["code"] == 400
            shared |= int(answer.headers["X-Batch-Size"]) > 1
    assert shared, "no bad request shared a batch"
    assert ping(server)


def test_request_options_from_json_and_headers(server, solo):
    import base64

    body = {"data": base64.b64encode(IMAGES["astronaut"]).decode(), "score_threshold": 0.05,
            "max_detections": 3}
    answer = requests.post(url(server), json=body, timeout=60)
    assert answer.status_code == 200
    assert_same_detections(answer.json(), rows_from_answer(solo["astronaut"][:3]))
    wanted = solo["astronaut"][0]["label"]
    only = detect(server, IMAGES["astronaut"], {**LOW, "X-Classes": wanted}).json()
    assert only and {d["label"] for d in only} == {wanted}
    assert len(only) == sum(d["label"] == wanted for d in solo["astronaut"])


def test_nothing_found_is_an_empty_list_not_an_error(server):
    answer = detect(server, IMAGES["rocket"], {"X-Score-Threshold": "1.0"})
    assert answer.status_code == 200 and answer.json() == []


def test_the_classifier_still_answers_beside_the_detector(server):
    reply = post_image(f"{server.inference_url}/predictions/efficientnet_lite0", photo_bytes("coffee.png"))
    assert reply.status == 200 and reply.body[0]["label"] == "espresso"


def test_bursts_of_48_photos_and_bad_payloads_each_get_their_own_answer(server):
    """The default configuration as `server start` runs it (TorchServe's queue of 100 for every
    model): bursts of 48 simultaneous requests, photos among bad payloads, none refused."""
    assert_burst_answers_each_as_alone(url(server))
    assert ping(server)
