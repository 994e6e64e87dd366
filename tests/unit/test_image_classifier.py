"""The classifier handler, loaded from the real archive, driven in-process with a fake context."""

from __future__ import annotations

import json
from typing import Any

from handlers.image_classifier import ImageClassifierHandler
from tests.answers import assert_same_answer
from tests.archives import archive_context
from tests.images import CAT_LABELS, photo_bytes, png_declaring_size
from torchserve_vision.local_handler import LocalContext

PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]


def run(handler: ImageClassifierHandler, rows: list[dict]) -> tuple[list[Any], LocalContext]:
    context = archive_context(handler.model_dir, request_headers=[{} for _ in rows])
    bodies = handler.handle(rows, context)
    return [json.loads(body) for body in bodies], context


def solo(handler: ImageClassifierHandler, image: bytes) -> list[dict]:
    answers, context = run(handler, [{"body": bytearray(image)}])
    assert context.status(0) == 200
    return answers[0]


def test_real_weights_see_a_cat_in_chelsea_and_espresso_in_coffee(classifier):
    assert solo(classifier, photo_bytes("chelsea.png"))[0]["label"] in CAT_LABELS
    assert solo(classifier, photo_bytes("coffee.png"))[0]["label"] == "espresso"


def test_the_photos_get_different_answers(classifier):
    top1 = {solo(classifier, photo_bytes(name))[0]["index"] for name in PHOTOS}
    assert len(top1) == len(PHOTOS)


def test_a_batch_answers_each_image_as_if_it_were_alone(classifier):
    images = [photo_bytes(name) for name in PHOTOS]
    answers, context = run(classifier, [{"body": bytearray(image)} for image in images])
    for image, answer in zip(images, answers, strict=True):
        assert_same_answer(answer, solo(classifier, image), classifier.precision)
    assert all(context.status(i) == 200 for i in range(len(images)))
    assert {context.response_headers[i]["X-Batch-Size"] for i in range(len(images))} == {"5"}


def test_bad_requests_get_their_own_status_and_batch_mates_are_unaffected(classifier):
    good = [photo_bytes("chelsea.png"), photo_bytes("rocket.jpg")]
    rows: list[dict] = [
        {"body": bytearray(good[0])},
        {"body": bytearray(b"definitely not an image")},
        {"body": {"data": "%%%"}},
        {"body": bytearray(good[1])},
        {"body": bytearray()},
    ]
    answers, context = run(classifier, rows)
    assert [context.status(i) for i in range(5)] == [200, 400, 400, 200, 400]
    assert answers[1]["type"] == "NotAnImage" and answers[1]["code"] == 400
    assert answers[2]["type"] == "InvalidBase64"
    assert answers[4]["type"] == "EmptyBody"
    assert_same_answer(answers[0], solo(classifier, good[0]), classifier.precision)
    assert_same_answer(answers[3], solo(classifier, good[1]), classifier.precision)
    assert all(context.content_types[i] == "application/json" for i in range(5))


def test_a_batch_of_only_bad_requests_answers_every_one(classifier):
    answers, context = run(classifier, [{"body": bytearray(b"x")}, {}])
    assert [context.status(0), context.status(1)] == [400, 400]
    assert len(answers) == 2


def test_an_image_over_the_pixel_limit_is_a_413_for_that_request_only(classifier):
    too_big = png_declaring_size(8000, 6000)  # 48 MP declared in a few hundred bytes
    answers, context = run(classifier, [{"body": bytearray(too_big)},
                                        {"body": bytearray(photo_bytes("coffee.png"))}])
    assert (context.status(0), answers[0]["type"]) == (413, "ImageTooLarge")
    assert context.status(1) == 200 and answers[1][0]["label"] == "espresso"


def test_top_k_comes_from_the_archive_settings(classifier):
    assert len(solo(classifier, photo_bytes("astronaut.png"))) == classifier.settings.top_k == 5


def test_torchserve_describe_request_gets_the_worker_runner_and_no_prediction(classifier):
    # What TorchServe sends for GET /models/{m}/{v}?customized=true: one row, header describe=True.
    context = archive_context(classifier.model_dir, request_headers=[{"describe": "True"}])
    (body,) = classifier.handle([{}], context)
    described = json.loads(body)
    assert described["device"] == "cpu" and described["precision"] == classifier.precision
    runner = described["runners"]["classifier"]
    choice = classifier.runners["classifier"]
    assert runner["runner"] == choice.runner != "eager" and runner["file"].startswith("compiled/model")
    assert runner["precision"] == choice.precision and runner["cpu_kind"] == choice.cpu_kind
    assert runner.get("solo_threads") == choice.solo_threads


def test_a_client_describe_header_on_an_image_request_or_a_batch_is_predicted_as_usual(classifier):
    image = bytearray(photo_bytes("coffee.png"))
    context = archive_context(classifier.model_dir, request_headers=[{"describe": "True"}, {}])
    bodies = classifier.handle([{"body": image}, {"body": image}], context)
    assert [json.loads(body)[0]["label"] for body in bodies] == ["espresso", "espresso"]
    context = archive_context(classifier.model_dir, request_headers=[{"describe": "True"}])
    (body,) = classifier.handle([{"body": image}], context)
    assert json.loads(body)[0]["label"] == "espresso" and context.status(0) == 200
