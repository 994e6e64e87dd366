"""The gRPC front's translation, call by call: a ModelInferRequest as the binary-extension HTTP
request the handlers read (parsed back with the handlers' own parser), an HTTP answer as typed
raw tensors that tritonclient.grpc's InferResult reads, HTTP errors as gRPC statuses."""

from __future__ import annotations

import json
import struct

import grpc
import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2

from handlers.request.inference_protocol import binary_v2_to_row
from torchserve_vision.grpc_front import (
    BINARY_HEADER,
    Refused,
    bytes_elements,
    deadline_headers,
    forwarded_headers,
    http_infer_request,
    infer_response,
    refusal,
)

JPEG, PNG = b"\xff\xd8\xff jpeg bytes", b"\x89PNG\r\n\x1a\n png bytes"


def infer_request(**fields) -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest(model_name="efficientnet_lite0", **fields)


def test_raw_bytes_inputs_become_the_binary_extension_the_handler_reads():
    request = infer_request(id="r7")
    request.inputs.add(name="image", datatype="BYTES", shape=[2])
    request.raw_input_contents.append(bytes_elements([JPEG, PNG]))
    request.parameters["top_k"].int64_param = 3
    request.parameters["timeout"].int64_param = 250_000
    path, headers, body = http_infer_request(request)
    assert path == "/v2/models/efficientnet_lite0/infer"
    header = json.loads(body[:int(headers[BINARY_HEADER])])
    assert header["id"] == "r7" and header["parameters"] == {"top_k": 3, "timeout": 250_000}
    row, v2 = binary_v2_to_row(body, headers[BINARY_HEADER])
    assert row == {"top_k": 3, "instances": [JPEG, PNG]} and (v2.id, v2.timeout_s) == ("r7", 0.25)


def test_bytes_contents_and_uint8_contents_travel_as_bytes():
    as_contents = infer_request(model_version="2.0")
    as_contents.inputs.add(name="image", datatype="BYTES", shape=[1]).contents.bytes_contents.append(JPEG)
    path, headers, body = http_infer_request(as_contents)
    assert path == "/v2/models/efficientnet_lite0/versions/2.0/infer"
    assert body[int(headers[BINARY_HEADER]):] == struct.pack("<I", len(JPEG)) + JPEG
    as_uint8 = infer_request()
    as_uint8.inputs.add(name="image", datatype="UINT8", shape=[len(PNG)]).contents.uint_contents.extend(PNG)
    _, headers, body = http_infer_request(as_uint8)
    assert body[int(headers[BINARY_HEADER]):] == PNG


@pytest.mark.parametrize("broken", ["no contents", "raw count", "no model"])
def test_requests_the_front_cannot_translate_are_invalid_arguments(broken):
    request = infer_request() if broken != "no model" else service_pb2.ModelInferRequest()
    request.inputs.add(name="image", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    if broken == "raw count":
        request.inputs.add(name="second", datatype="BYTES", shape=[1])
        request.raw_input_contents.append(bytes_elements([JPEG]))
    with pytest.raises(Refused) as refused:
        http_infer_request(request)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


ANSWER = {"model_name": "efficientnet_lite0", "model_version": "1.0", "id": "r7", "outputs": [
    {"name": "labels", "datatype": "BYTES", "shape": [2, 2], "data": ["tabby", "tiger cat", "ox", "yak"]},
    {"name": "probabilities", "datatype": "FP32", "shape": [2, 2], "data": [0.5, 0.25, 0.75, 0.125]},
    {"name": "class_ids", "datatype": "INT64", "shape": [2, 2], "data": [281, 282, 345, 346]}]}


def test_an_answer_becomes_raw_tensors_that_tritonclient_reads():
    result = InferResult(infer_response(ANSWER, []))
    assert result.get_response().id == "r7" and result.get_response().model_version == "1.0"
    assert result.as_numpy("labels").tolist() == [[b"tabby", b"tiger cat"], [b"ox", b"yak"]]
    np.testing.assert_array_equal(result.as_numpy("probabilities"),
                                  np.array([[0.5, 0.25], [0.75, 0.125]], dtype=np.float32))
    assert result.as_numpy("class_ids").dtype == np.int64
    assert result.as_numpy("class_ids").tolist() == [[281, 282], [345, 346]]


def test_only_the_asked_outputs_come_back_and_an_unknown_one_is_refused():
    response = infer_response(ANSWER, ["class_ids", "labels"])
    assert [output.name for output in response.outputs] == ["labels", "class_ids"]
    assert len(response.raw_output_contents) == 2
    with pytest.raises(Refused) as refused:
        infer_response(ANSWER, ["boxes"])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "boxes" in refused.value.details


@pytest.mark.parametrize("status, body, code, details", [
    (400, b'{"error": "image 0: the body is text"}', grpc.StatusCode.INVALID_ARGUMENT,
     "image 0: the body is text"),
    (413, b'{"code": 413, "type": "TooManyImages", "message": "17 images"}',
     grpc.StatusCode.RESOURCE_EXHAUSTED, "17 images"),
    (400, b'{"code": 400, "type": "InvalidKeyException", "message": "Token Authorization failed"}',
     grpc.StatusCode.UNAUTHENTICATED, "Token Authorization failed"),
    (404, b'{"code": 404, "type": "ModelNotFoundException", "message": "Model not found"}',
     grpc.StatusCode.NOT_FOUND, "Model not found"),
    (503, b"<html>busy</html>", grpc.StatusCode.UNAVAILABLE, "<html>busy</html>"),
    (507, b"", grpc.StatusCode.INTERNAL, "HTTP 507"),
])
def test_http_errors_become_grpc_statuses_with_their_message(status, body, code, details):
    refused = refusal(status, body)
    assert (refused.code, refused.details) == (code, details)


def test_the_calls_metadata_travels_as_headers_but_grpcs_own_does_not():
    metadata: list[tuple[str, str | bytes]] = [
        ("authorization", "Bearer k"), ("x-top-k", "2"), ("user-agent", "grpc-python"),
        ("grpc-accept-encoding", "gzip"), ("trace-bin", b"\x00\x01")]
    assert forwarded_headers(metadata) == {"authorization": "Bearer k", "x-top-k": "2"}


def test_the_calls_deadline_travels_as_the_requests_deadline_unless_the_metadata_names_one():
    assert deadline_headers(0.2504, {}) == {"X-Request-Timeout-Ms": "251"}
    assert deadline_headers(0.0001, {}) == {"X-Request-Timeout-Ms": "1"}      # never 0 (a 400)
    assert deadline_headers(None, {}) == {}
    # grpcio's ServicerContext.time_remaining() for a call without a deadline
    assert deadline_headers(1.8e19, {}) == {} and deadline_headers(float("inf"), {}) == {}
    assert deadline_headers(0.25, {"x-request-timeout-ms": "100"}) == {}
