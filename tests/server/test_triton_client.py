"""`tritonclient.http`, the most used Open Inference Protocol client, unchanged against a real
TorchServe started from the project's config: the binary tensor extension (its default: BYTES
elements holding the encoded image, or UINT8 of shape [n] as Triton's DALI pipelines send),
JSON without a Content-Type (base64 text), request parameters as options, `id` echoed, and a
refused image raised as the client's error with the server's message."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.images import CAT_LABELS, photo_bytes
from torchserve_vision.server_process import TorchServeInstance

pytestmark = pytest.mark.server
CLASSIFIER, DETECTOR = "efficientnet_lite0", "ssd_mobilenet_v2"


def client_of(server: TorchServeInstance) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.inference_url.removeprefix("http://"))


def image_input(image: bytes, datatype: str = "BYTES", binary: bool = True) -> triton.InferInput:
    if datatype == "UINT8":
        tensor = triton.InferInput("image", [len(image)], "UINT8")
        tensor.set_data_from_numpy(np.frombuffer(image, dtype=np.uint8), binary_data=binary)
        return tensor
    tensor = triton.InferInput("image", [1], "BYTES")
    data = image if binary else base64.b64encode(image)
    tensor.set_data_from_numpy(np.array([data], dtype=np.object_), binary_data=binary)
    return tensor


def labels(result: triton.InferResult) -> list[list[str]]:
    """Per image, its labels (the outputs lead with the number of images)."""
    return [[value.decode() if isinstance(value, bytes) else str(value) for value in row]
            for row in result.as_numpy("labels").tolist()]


def labels_of_one(result: triton.InferResult) -> list[str]:
    return [value.decode() if isinstance(value, bytes) else str(value)
            for value in result.as_numpy("labels").tolist()]


@pytest.mark.parametrize("datatype, binary", [("BYTES", True), ("UINT8", True), ("BYTES", False)],
                         ids=["bytes-binary", "uint8-binary", "base64-json"])
def test_tritonclient_classifies_a_photo_in_each_encoding(server, datatype, binary):
    result = client_of(server).infer(CLASSIFIER, [image_input(photo_bytes("chelsea.png"), datatype, binary)],
                                     request_id="r1", parameters={"top_k": 3})
    # a UINT8 input is one encoded image, answered without the leading number of images
    found = labels(result)[0] if datatype == "BYTES" else labels_of_one(result)
    assert len(found) == 3 and found[0] in CAT_LABELS
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == ((1, 3) if datatype == "BYTES" else (3,))
    probabilities = probabilities.reshape(-1)
    assert probabilities[0] >= probabilities[1] >= probabilities[2]
    assert result.get_response()["id"] == "r1"


def test_tritonclient_reaches_the_detector(server):
    result = client_of(server).infer(DETECTOR, [image_input(photo_bytes("astronaut.png"))],
                                     parameters={"max_detections": 4, "score_threshold": 0.0})
    assert result.as_numpy("boxes").shape == (1, 4, 4) and result.as_numpy("scores").shape == (1, 4)


def test_a_refused_image_is_the_clients_error_with_the_servers_message(server):
    with pytest.raises(InferenceServerException) as raised:
        client_of(server).infer(CLASSIFIER, [image_input(b"\xff\xd8 not really a jpeg")])
    assert raised.value.status() == "400" and "image" in raised.value.message().lower()


def test_tritonclient_sees_the_server_live_and_ready_with_its_metadata(server):
    """`ts_open_inference_protocol=true` in the project's configs (production included): v2
    health and server metadata on the inference port. (`GET /v2/models/{m}` and its `/ready`
    are not routed by TorchServe 0.12 in any mode: not asserted here.)"""
    client = client_of(server)
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"]
