"""The Open Inference Protocol (KServe v2) on `POST /v2/models/{m}/infer` of a real TorchServe:
v2 requests are batched with each other and with `/predictions` requests, each answered on its
own, in its own form; a malformed v2 body is a 400 in v2's error form for that request alone."""

from __future__ import annotations

import base64
import functools
import random

import pytest
import requests

from tests.answers import assert_same_answer, served_classifier_precision
from tests.images import CAT_LABELS, photo_bytes
from tests.server.http_client import Reply, concurrently, post_image, session
from torchserve_vision.server_process import TorchServeInstance

pytestmark = pytest.mark.server
CLASSIFIER, DETECTOR = "efficientnet_lite0", "ssd_mobilenet_v2"
PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]


def v2_body(photo: str, request_id: str | None = None, **parameters: object) -> dict:
    body: dict = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                              "data": [base64.b64encode(photo_bytes(photo)).decode()]}]}
    if request_id is not None:
        body["id"] = request_id
    if parameters:
        body["parameters"] = parameters
    return body


def post_v2(server: TorchServeInstance, model: str, body: object) -> Reply:
    answer = session().post(f"{server.inference_url}/v2/models/{model}/infer", json=body, timeout=120)
    batch_size = answer.headers.get("X-Batch-Size")
    return Reply(answer.status_code, answer.json(), int(batch_size) if batch_size else None)


def outputs(reply: Reply) -> dict[str, dict]:
    return {output["name"]: output for output in reply.body["outputs"]}


def as_class_scores(reply: Reply) -> list[dict]:
    tensors = outputs(reply)
    return [{"label": label, "index": index, "probability": probability}
            for label, index, probability in zip(tensors["labels"]["data"], tensors["class_ids"]["data"],
                                                  tensors["probabilities"]["data"], strict=True)]


def test_a_v2_request_gets_a_v2_answer_with_its_id_and_top_k(server):
    reply = post_v2(server, CLASSIFIER, v2_body("chelsea.png", "request-7", top_k=3))
    assert reply.status == 200, reply.body
    assert reply.body["model_name"] == CLASSIFIER and reply.body["model_version"] == "1.0"
    assert reply.body["id"] == "request-7"
    tensors = outputs(reply)
    assert set(tensors) == {"labels", "probabilities", "class_ids"}
    assert tensors["labels"]["datatype"] == "BYTES" and tensors["labels"]["shape"] == [1, 3]
    assert tensors["probabilities"]["datatype"] == "FP32" and tensors["class_ids"]["datatype"] == "INT64"
    assert tensors["labels"]["data"][0] in CAT_LABELS
    probabilities = tensors["probabilities"]["data"]
    assert probabilities == sorted(probabilities, reverse=True)
    assert "id" not in post_v2(server, CLASSIFIER, v2_body("coffee.png")).body


def test_v2_and_predictions_requests_share_batches_and_each_gets_its_own_answer(server):
    alone = {name: post_image(f"{server.inference_url}/predictions/{CLASSIFIER}", photo_bytes(name)).body
             for name in PHOTOS}
    assert len({answer[0]["index"] for answer in alone.values()}) == len(PHOTOS)
    plan = [(name, protocol) for name in PHOTOS for protocol in ("v2", "predictions")] * 4
    random.Random(0).shuffle(plan)

    def call(index: int, name: str, protocol: str) -> Reply:
        if protocol == "v2":
            return post_v2(server, CLASSIFIER, v2_body(name, f"r{index}"))
        return post_image(f"{server.inference_url}/predictions/{CLASSIFIER}", photo_bytes(name))

    replies = concurrently([functools.partial(call, i, n, p) for i, (n, p) in enumerate(plan)], 16)
    precision = served_classifier_precision()
    for index, ((name, protocol), reply) in enumerate(zip(plan, replies, strict=True)):
        assert reply.status == 200, reply.body
        if protocol == "v2":
            assert reply.body["id"] == f"r{index}"
            assert_same_answer(as_class_scores(reply), alone[name], precision)
        else:
            assert_same_answer(reply.body, alone[name], precision)
    assert max(reply.batch_size or 0 for reply in replies) > 1


@pytest.mark.parametrize("body, message", [
    ({"inputs": []}, "list of one input"),
    ({"inputs": [{"name": "image", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, "BYTES"),
    ({"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES", "data": ["aGk="]}]},
     "2 base64 string(s)"),
    ({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["%%%"]}]},
     "image 0: 'data' is not valid base64"),
    ({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                  "data": [base64.b64encode(b"not an image").decode()]}]}, "image"),
    ({**v2_body("coffee.png"), "parameters": {"top_k": 0}}, "top_k"),
    ({**v2_body("coffee.png"), "id": 5}, "'id'"),
])
def test_a_malformed_v2_request_gets_a_v2_error_and_its_batch_mates_their_answers(server, body, message):
    calls = [functools.partial(post_v2, server, CLASSIFIER, body)] + [
        functools.partial(post_v2, server, CLASSIFIER, v2_body("chelsea.png", f"ok{i}")) for i in range(7)]
    bad, *good = concurrently(calls, 8)
    assert bad.status == 400 and set(bad.body) == {"error"} and message in bad.body["error"], bad.body
    assert all(r.status == 200 and outputs(r)["labels"]["data"][0] in CAT_LABELS for r in good)
    assert [r.body["id"] for r in good] == [f"ok{i}" for i in range(7)]


def test_the_detector_answers_v2_with_the_same_detections_and_options(server):
    options = {"score_threshold": 0.05, "max_detections": 5}
    for name in ("astronaut.png", "motorcycle_left.png"):
        plain = requests.post(f"{server.inference_url}/predictions/{DETECTOR}",
                              json={"data": base64.b64encode(photo_bytes(name)).decode(), **options},
                              timeout=120).json()
        reply = post_v2(server, DETECTOR, v2_body(name, name, **options))
        assert reply.status == 200, reply.body
        tensors = outputs(reply)
        n = len(plain)
        assert 0 < n <= 5
        assert tensors["boxes"]["shape"] == [1, n, 4] and tensors["scores"]["shape"] == [1, n]
        assert tensors["labels"]["data"] == [d["label"] for d in plain]
        assert tensors["class_ids"]["data"] == [d["index"] for d in plain]
        assert tensors["scores"]["data"] == pytest.approx([d["score"] for d in plain], abs=1e-5)
        assert tensors["boxes"]["data"] == pytest.approx([c for d in plain for c in d["box"]], abs=1e-3)
    refused = post_v2(server, DETECTOR, v2_body("astronaut.png", classes=["no-such-class"]))
    assert refused.status == 400 and "classes" in refused.body["error"]
