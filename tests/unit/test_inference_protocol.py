"""The Open Inference Protocol's request and response forms, without a server."""

from __future__ import annotations

import json

import pytest

from handlers.ground.errors import ClientError
from handlers.request.classification_options import parse_classification_options
from handlers.request.inference_protocol import (
    V2Request,
    binary_v2_to_row,
    classification_outputs,
    detection_outputs,
    is_v2_request,
    stacked_outputs,
    tensor,
    v2_error,
    v2_json_in_bytes,
    v2_response,
    v2_to_row,
)
from handlers.request.request_body import extract_images


def image_input(data: object = "aGVsbG8=", shape: object = (1,), datatype: str = "BYTES") -> dict:
    return {"name": "image", "shape": list(shape) if isinstance(shape, tuple) else shape,
            "datatype": datatype, "data": data}


def test_a_v2_request_becomes_the_row_of_the_equivalent_json_request():
    row, request = v2_to_row({"id": "a1", "parameters": {"top_k": 2}, "inputs": [image_input()]})
    assert row == {"body": {"top_k": 2, "instances": ["aGVsbG8="]}}
    assert request == V2Request("a1")
    nested, _ = v2_to_row({"inputs": [image_input([["aGVsbG8="]], shape=[1, 1])]})
    assert nested["body"]["instances"] == ["aGVsbG8="]
    several, _ = v2_to_row({"inputs": [image_input(["aGk=", "aGVsbG8=", "eW8="], shape=[3])]})
    assert extract_images(several) == ([b"hi", b"hello", b"yo"], True)


def test_only_bodies_with_inputs_are_v2_requests():
    assert is_v2_request({"inputs": []})
    assert not is_v2_request({"data": "aGVsbG8="})
    assert not is_v2_request(bytearray(b"inputs"))


@pytest.mark.parametrize("body", [
    {"inputs": "x"},
    {"inputs": [image_input(), image_input()]},
    {"inputs": [image_input(datatype="UINT8")]},
    {"inputs": [image_input(["aGk="], shape=[2])]},
    {"inputs": [image_input(["aGk=", "aGk="], shape=[2, 2])]},
    {"inputs": [image_input(shape=[0])]},
    {"inputs": [image_input(shape="1")]},
    {"inputs": [image_input(data=[1])]},
    {"inputs": [image_input()], "id": 3},
    {"inputs": [image_input()], "parameters": []},
    {"inputs": [image_input()], "parameters": {"data": "aGVsbG8="}},
])
def test_malformed_v2_requests_are_client_errors(body):
    with pytest.raises(ClientError) as raised:
        v2_to_row(body)
    assert raised.value.status == 400
    assert v2_error(raised.value) == {"error": raised.value.message}


def test_answers_are_v2_tensors_in_the_order_of_the_json_answer():
    scores = [{"label": "tabby", "index": 281, "probability": 0.7},
              {"label": "tiger cat", "index": 282, "probability": 0.2}]
    response = v2_response("m", "1.0", V2Request("x"), classification_outputs(scores))
    assert response == {"model_name": "m", "model_version": "1.0", "id": "x", "outputs": [
        {"name": "labels", "shape": [2], "datatype": "BYTES", "data": ["tabby", "tiger cat"]},
        {"name": "probabilities", "shape": [2], "datatype": "FP32", "data": [0.7, 0.2]},
        {"name": "class_ids", "shape": [2], "datatype": "INT64", "data": [281, 282]}]}
    boxes = detection_outputs([{"label": "dog", "index": 18, "score": 0.9, "box": [1, 2, 3, 4]},
                               {"label": "cat", "index": 17, "score": 0.5, "box": [5, 6, 7, 8]}])
    assert boxes[0] == {"name": "boxes", "shape": [2, 4], "datatype": "FP32",
                        "data": [1, 2, 3, 4, 5, 6, 7, 8]}
    assert detection_outputs([])[0]["shape"] == [0, 4]
    assert "id" not in v2_response("m", "1.0", V2Request(None), [])


def parse_top_k(row, header, default: int, class_count: int) -> int:
    return parse_classification_options(row, header, default, class_count).top_k


def test_top_k_comes_from_the_body_then_the_header_then_the_default():
    no_header = lambda name: None  # noqa: E731
    assert parse_top_k({"body": {"data": "x", "top_k": 3}}, lambda name: "4", 5, 1000) == 3
    assert parse_top_k({"body": bytearray(b"img")}, lambda name: "4", 5, 1000) == 4
    assert parse_top_k({"data": b"img", "top_k": b"2"}, no_header, 5, 1000) == 2
    assert parse_top_k({"body": bytearray(b"img")}, no_header, 5, 1000) == 5
    for bad in (0, 1001, "three", True):
        with pytest.raises(ClientError):
            parse_top_k({"body": {"top_k": bad}}, no_header, 5, 1000)


def binary_request(image: bytes, datatype: str = "BYTES", **parameters: object) -> tuple[bytes, str]:
    """A body in the binary tensor extension and its Inference-Header-Content-Length."""
    data = image if datatype == "UINT8" else len(image).to_bytes(4, "little") + image
    shape = [len(image)] if datatype == "UINT8" else [1]
    header = json.dumps({"id": "9", "parameters": {"binary_data_output": True, **parameters},
                         "inputs": [{"name": "image", "shape": shape, "datatype": datatype,
                                     "parameters": {"binary_data_size": len(data)}}]}).encode()
    return header + data, str(len(header))


def test_the_binary_tensor_extension_gives_the_image_bytes_and_the_options():
    body, length = binary_request(b"\x89PNG image bytes", "UINT8", top_k=2)
    assert binary_v2_to_row(body, length) == ({"top_k": 2, "data": b"\x89PNG image bytes"},
                                              V2Request("9"))
    body, length = binary_request(b"\x89PNG image bytes", "BYTES", top_k=2)
    row, request = binary_v2_to_row(body, length)
    assert row == {"top_k": 2, "instances": [b"\x89PNG image bytes"]} and request == V2Request("9")
    assert extract_images(row) == ([b"\x89PNG image bytes"], True)


@pytest.mark.parametrize("timeout, seconds", [(250_000, 0.25), (0, None)])
def test_the_timeout_parameter_is_the_requests_deadline_not_a_model_option(timeout, seconds):
    body, length = binary_request(b"\x89PNG image bytes", "UINT8", top_k=2, timeout=timeout)
    row, request = binary_v2_to_row(body, length)
    assert request == V2Request("9", seconds) and "timeout" not in row


@pytest.mark.parametrize("timeout", [-1, 1.5, "250", True])
def test_a_timeout_that_is_not_whole_microseconds_is_a_400(timeout):
    body, length = binary_request(b"\x89PNG image bytes", "UINT8", timeout=timeout)
    with pytest.raises(ClientError) as refused:
        binary_v2_to_row(body, length)
    assert refused.value.status == 400 and "timeout" in str(refused.value)


def test_a_binary_bytes_input_of_shape_n_gives_n_images():
    images = [b"first", b"", b"third image"]
    data = b"".join(len(image).to_bytes(4, "little") + image for image in images)
    header = json.dumps({"inputs": [{"name": "image", "shape": [3], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(data)}}]}).encode()
    row, _ = binary_v2_to_row(header + data, str(len(header)))
    assert row == {"instances": images}
    with pytest.raises(ClientError, match="image 1: the image is empty"):
        extract_images(row)
    with pytest.raises(ClientError) as raised:
        extract_images({"instances": images}, max_images=2)
    assert (raised.value.status, raised.value.error_type) == (413, "TooManyImages")


def test_kserve_v1_instances_are_the_request_images_in_order():
    row = {"body": {"instances": [{"data": "aGk="}, "eW8="], "top_k": 2}}
    assert extract_images(row) == ([b"hi", b"yo"], True)
    assert extract_images({"body": {"data": "aGk="}}) == ([b"hi"], False)
    for bad, message in (([], "non-empty"), ("aGk=", "non-empty"), ([{"data": "%%"}], "image 0"),
                         (["aGk=", {"image": "aGk="}], "image 1")):
        with pytest.raises(ClientError, match=message) as raised:
            extract_images({"body": {"instances": bad}})
        assert raised.value.status == 400


def test_outputs_of_several_images_lead_with_their_number_and_ragged_ones_are_padded():
    first = [tensor("boxes", "FP32", [2, 4], [1, 2, 3, 4, 5, 6, 7, 8]),
             tensor("labels", "BYTES", [2], ["dog", "cat"]), tensor("model", "BYTES", [1], ["a"])]
    second = [tensor("boxes", "FP32", [1, 4], [9, 9, 9, 9]), tensor("labels", "BYTES", [1], ["cow"]),
              tensor("model", "BYTES", [1], ["b"])]
    stacked = {output["name"]: output for output in stacked_outputs([first, second])}
    assert stacked["boxes"] == tensor("boxes", "FP32", [2, 2, 4],
                                      [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 0, 0, 0, 0])
    assert stacked["boxes_shapes"] == tensor("boxes_shapes", "INT64", [2, 2], [2, 4, 1, 4])
    assert stacked["labels"]["data"] == ["dog", "cat", "cow", ""]
    assert stacked["model"] == tensor("model", "BYTES", [2, 1], ["a", "b"])   # same shapes: no padding
    assert "model_shapes" not in stacked
    assert [o["name"] for o in stacked_outputs([first])] == ["boxes", "labels", "model"]
    assert stacked_outputs([first])[0]["shape"] == [1, 2, 4]


@pytest.mark.parametrize("change", ["length", "size", "element", "shape", "datatype"])
def test_a_malformed_binary_request_is_a_400(change):
    body, length = binary_request(b"image")
    json_part, data = body[:int(length)], body[int(length):]
    if change == "length":
        length = str(int(length) + 3)
    elif change == "size":
        body = body + b"extra"
    elif change == "element":
        body = json_part + (99).to_bytes(4, "little") + data[4:]
    elif change == "shape":
        body = body.replace(b'"shape": [1]', b'"shape": [2]')   # says 2 elements, holds 1
    else:
        body = body.replace(b'"BYTES"', b'"FP32" ')
        length = str(int(length) + 1)
    with pytest.raises(ClientError) as raised:
        binary_v2_to_row(body, length)
    assert raised.value.status == 400


def test_json_sent_as_bytes_is_read_as_a_v2_request_and_other_bytes_are_not():
    body = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                   "data": ["aGk="]}]}).encode()
    assert v2_json_in_bytes(body) == json.loads(body)
    assert v2_json_in_bytes(b"\x89PNG") is None and v2_json_in_bytes(b'{"data": "aGk="}') is None
