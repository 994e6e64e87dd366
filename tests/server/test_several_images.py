"""Several images in one request on a real TorchServe, with the clients users run: tritonclient
(a v2 input of shape [n], binary and base64 JSON) and curl (KServe v1 `instances` on
`/v1/models/{m}:predict`, which TorchServe routes to the model). One answer per image, in order,
each the same as that image sent alone; a bad image fails its own request, naming the image,
and never its batch-mates; more images than the model's limit is a 413."""

from __future__ import annotations

import base64
import functools
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as triton
from PIL import Image
from tritonclient.utils import InferenceServerException

from tests.answers import assert_same_answer, served_classifier_precision
from tests.images import encode, photo_bytes, textured_rgb
from tests.server.http_client import concurrently
from torchserve_vision.lab.benchmark_images import benchmark_jpeg
from torchserve_vision.model_descriptions import load_descriptions
from torchserve_vision.paths import MODEL_DESCRIPTIONS
from torchserve_vision.server_process import TorchServeInstance

pytestmark = pytest.mark.server
CLASSIFIER, DETECTOR = "efficientnet_lite0", "ssd_mobilenet_v2"
# A mix of sizes and formats: a 600x400 PNG, a JPEG, a 12 MP phone JPEG, a 720x720 JPEG.
MIX = ("coffee.png", "rocket.jpg", "phone", "small")


def image_bytes(name: str) -> bytes:
    return benchmark_jpeg(name) if name in ("phone", "small") else photo_bytes(name)


def alone(server: TorchServeInstance, model: str, image: bytes, **options: object) -> list[dict]:
    reply = requests.post(f"{server.inference_url}/predictions/{model}", timeout=120,
                          json={"data": base64.b64encode(image).decode(), **options})
    assert reply.status_code == 200, reply.text
    return reply.json()


def client_of(server: TorchServeInstance) -> triton.InferenceServerClient:
    """A client of its own per thread: tritonclient.http's is not safe to share between threads."""
    return triton.InferenceServerClient(server.inference_url.split("://", 1)[1])


def several_input(images: list[bytes], binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("image", [len(images)], "BYTES")
    data = images if binary else [base64.b64encode(image) for image in images]
    tensor.set_data_from_numpy(np.array(data, dtype=np.object_), binary_data=binary)
    return tensor


def rows_of(result: triton.InferResult) -> list[list[dict]]:
    """Each image's class scores from the stacked outputs."""
    labels, ids, probabilities = (result.as_numpy(name).tolist()
                                  for name in ("labels", "class_ids", "probabilities"))
    return [[{"label": label.decode() if isinstance(label, bytes) else str(label), "index": index,
              "probability": probability}
             for label, index, probability in zip(*row, strict=True)]
            for row in zip(labels, ids, probabilities, strict=True)]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "base64-json"])
def test_tritonclient_sends_several_images_and_gets_each_answer_in_order(server, binary):
    images = [image_bytes(name) for name in MIX]
    expected = [alone(server, CLASSIFIER, image, top_k=3) for image in images]
    result = client_of(server).infer(CLASSIFIER, [several_input(images, binary)], request_id="many",
                                     parameters={"top_k": 3})
    assert result.get_response()["id"] == "many"
    assert result.as_numpy("labels").shape == (len(images), 3)
    rows = rows_of(result)
    for got, wanted in zip(rows, expected, strict=True):
        assert_same_answer(got, wanted, served_classifier_precision())
    assert len({row[0]["index"] for row in rows}) == len(images)


def test_a_bad_image_fails_only_its_request_and_names_the_image(server):
    good = [image_bytes("chelsea.png"), image_bytes("rocket.jpg")]

    def bad_request() -> list[list[dict]]:
        with pytest.raises(InferenceServerException) as raised:
            client_of(server).infer(
                CLASSIFIER, [several_input([good[0], b"\xff\xd8 not a jpeg", good[1]], True)])
        return [[{"refused": f"{raised.value.status()} {raised.value.message()}"}]]

    def good_request() -> list[list[dict]]:
        return rows_of(client_of(server).infer(CLASSIFIER, [several_input(good, True)]))

    (((refused,),), *answered) = concurrently([bad_request] + [good_request] * 5, 6)
    assert refused["refused"].startswith("400 image 1: "), refused
    expected = [alone(server, CLASSIFIER, image) for image in good]
    for rows in answered:
        for got, wanted in zip(rows, expected, strict=True):
            assert_same_answer(got, wanted, served_classifier_precision())


def test_curl_sends_kserve_v1_instances_and_gets_predictions_in_order(server, tmp_path: Path):
    images = [image_bytes(name) for name in ("coffee.png", "chelsea.png", "small")]
    body = tmp_path / "instances.json"
    body.write_text(json.dumps({"instances": [{"data": base64.b64encode(i).decode()} for i in images],
                                "top_k": 2}))
    answer = subprocess.run(
        ["curl", "-s", "-X", "POST", "-H", "Content-Type: application/json", "--data", f"@{body}",
         "-w", "\n%{http_code}", f"{server.inference_url}/v1/models/{CLASSIFIER}:predict"],
        check=True, capture_output=True, text=True, timeout=120).stdout
    text, status = answer.rsplit("\n", 1)
    assert status == "200", text
    predictions = json.loads(text)["predictions"]
    assert len(predictions) == 3 and predictions[0][0]["label"] == "espresso"
    for got, image in zip(predictions, images, strict=True):
        assert_same_answer(got, alone(server, CLASSIFIER, image, top_k=2), served_classifier_precision())


def test_more_images_than_the_models_limit_is_a_413(server):
    (classifier,) = [d for d in load_descriptions(MODEL_DESCRIPTIONS) if d.name == CLASSIFIER]
    limit = int(classifier.handler_options.get("limits", {}).get("max_images_per_request", 16))
    tiny = base64.b64encode(encode(textured_rgb(32, 32), "JPEG")).decode()
    post = functools.partial(requests.post, f"{server.inference_url}/v1/models/{CLASSIFIER}:predict",
                             timeout=120)
    refused = post(json={"instances": [tiny] * (limit + 1)})
    assert refused.status_code == 413 and refused.json()["type"] == "TooManyImages", refused.text
    assert len(post(json={"instances": [tiny] * limit}).json()["predictions"]) == limit


def test_the_detectors_ragged_outputs_are_padded_with_each_images_shape(server):
    # At 0.2 the astronaut has 2 boxes (person 0.84, and the helmet as a mouse, 0.40 in fp32 and
    # 0.35 in bf16; the next is under 0.1) and a plain grey picture none (nothing even at 0.05).
    images = [photo_bytes("astronaut.png"), encode(Image.new("RGB", (480, 360), (128, 128, 128)), "PNG")]
    options = {"score_threshold": 0.2, "max_detections": 6}
    expected = [alone(server, DETECTOR, image, **options) for image in images]
    assert [len(answer) for answer in expected] == [2, 0]
    result = client_of(server).infer(DETECTOR, [several_input(images, True)], parameters=options)
    boxes, counts = result.as_numpy("boxes"), result.as_numpy("boxes_shapes")
    assert boxes.shape == (2, max(len(answer) for answer in expected), 4)
    assert counts.tolist() == [[len(answer), 4] for answer in expected]
    for row, (count, _), answer in zip(boxes, counts.tolist(), expected, strict=True):
        assert row[:count].reshape(-1).tolist() == pytest.approx(
            [c for detection in answer for c in detection["box"]], abs=1e-3)
        assert not row[count:].any()                       # the padding is zeros
