"""Several images in one request (KServe v1 `instances`, a v2 input of shape [n]), through the
tiny classifier's real handler path in-process: one answer per image, in order, the same as each
image alone; the images join the batch with other requests' and run in chunks of the batch
size; a bad image fails its own request, naming the image; too many is a 413."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import torch

from tests.images import photo_bytes
from tests.v2_metadata import assert_outputs_follow_metadata
from torchserve_vision.local_handler import LocalContext, archive_context

PHOTOS = ("chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png")
# The tiny classifier runs in fp32; a batch of 2 sums in another order than a batch of 1.
FP32_SUMMATION = 256 * torch.finfo(torch.float32).eps


def same_scores(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert [score["index"] for score in got] == [score["index"] for score in expected]
    assert [score["probability"] for score in got] == pytest.approx(
        [score["probability"] for score in expected], abs=FP32_SUMMATION)


def b64(name: str) -> str:
    return base64.b64encode(photo_bytes(name)).decode()


def run(handler: Any, bodies: list[Any]) -> tuple[list[Any], LocalContext]:
    context = archive_context(handler.model_dir, request_headers=[{} for _ in bodies])
    answers = handler.handle([{"body": body} for body in bodies], context)
    return [json.loads(answer) for answer in answers], context


@pytest.fixture
def chunked(tiny_classifier, monkeypatch):
    """The tiny classifier with a batch size of 2, counting the images of each model batch."""
    monkeypatch.setattr(tiny_classifier, "max_batch_size", 2)
    sizes: list[int] = []
    original = tiny_classifier.answer_items

    def counting(items, record):
        sizes.append(len(items))
        return original(items, record)

    monkeypatch.setattr(tiny_classifier, "answer_items", counting)
    return tiny_classifier, sizes


def test_instances_get_one_answer_per_image_in_order_beside_other_requests(chunked):
    handler, sizes = chunked
    alone = [run(handler, [bytearray(photo_bytes(name))])[0][0] for name in PHOTOS]
    sizes.clear()
    (several, single), context = run(handler, [
        {"instances": [{"data": b64(name)} for name in PHOTOS[:3]], "top_k": 2},
        bytearray(photo_bytes(PHOTOS[3]))])
    assert [context.status(i) for i in range(2)] == [200, 200]
    assert list(several) == ["predictions"] and len(several["predictions"]) == 3
    for got, expected in zip(several["predictions"], alone[:3], strict=True):
        same_scores(got, expected[:2])
    same_scores(single, alone[3])
    assert len({answer[0]["index"] for answer in alone}) > 1       # the photos are told apart
    assert sizes == [2, 2]          # four images of two requests, in chunks of the batch size


def test_a_bad_image_fails_only_its_request_and_names_the_image(chunked):
    handler, _ = chunked
    (bad, good), context = run(handler, [
        {"instances": [b64("chelsea.png"), base64.b64encode(b"not an image").decode()]},
        {"instances": [b64("coffee.png")]}])
    assert context.status(0) == 400 and bad["message"].startswith("image 1: ")
    assert context.status(1) == 200 and len(good["predictions"]) == 1


def test_more_images_than_the_limit_is_a_413(tiny_classifier):
    limit = tiny_classifier.settings.limits.max_images_per_request
    (refused,), context = run(tiny_classifier, [{"instances": [b64("coffee.png")] * (limit + 1)}])
    assert context.status(0) == 413 and refused["type"] == "TooManyImages"


def test_a_v2_request_of_n_images_answers_outputs_that_lead_with_n(tiny_classifier):
    body = {"id": "v", "parameters": {"top_k": 3}, "inputs": [
        {"name": "image", "shape": [2], "datatype": "BYTES", "data": [b64("chelsea.png"),
                                                                        b64("rocket.jpg")]}]}
    (answer,), context = run(tiny_classifier, [body])
    assert context.status(0) == 200 and answer["id"] == "v"
    outputs = {output["name"]: output for output in answer["outputs"]}
    assert outputs["labels"]["shape"] == [2, 3] and len(outputs["probabilities"]["data"]) == 6
    alone = [run(tiny_classifier, [bytearray(photo_bytes(name))])[0][0]
             for name in ("chelsea.png", "rocket.jpg")]
    assert outputs["labels"]["data"] == [score["label"] for answer in alone for score in answer[:3]]


def test_the_v2_metadata_declares_what_the_classifier_answers(tiny_classifier):
    body = {"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES",
                        "data": [b64("chelsea.png"), b64("rocket.jpg")]}]}
    (answer,), _ = run(tiny_classifier, [body])
    assert_outputs_follow_metadata(answer["outputs"], tiny_classifier.describe()["v2"], images=2)
