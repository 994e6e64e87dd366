"""The Open Inference Protocol (KServe v2) for one request inside a batch, as pure functions.

TorchServe routes `POST /v2/models/{model}/infer` to the model and hands the handler the JSON
body already parsed, like any `application/json` request; the handler reads it itself (TorchServe's
`kservev2` envelope would break batching: it takes only the first request of a batch). A request:

    {"id": "42", "parameters": {"top_k": 3},
     "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["<base64 image>"]}]}

The body may also come as bytes: a client that sends JSON without a Content-Type
(`tritonclient.http` does), or the **binary tensor extension** (`tritonclient.http`'s default):
header `Inference-Header-Content-Length: <n>`, the first n bytes the JSON request (each binary
input with `"parameters": {"binary_data_size": <bytes>}`), then the inputs' bytes. An image
input is `BYTES` of shape [1] (base64 text in JSON; in binary, a 4-byte little-endian length and
the encoded image) or `UINT8` of shape [n] in binary (the n bytes of one encoded image, the
convention of Triton's DALI pipelines). `binary_data_output` is not honoured: outputs are small
(classes, probabilities, boxes) and always come as JSON, which `InferResult.as_numpy` reads.

One image per request (shape [1]); request `parameters` are the request's options, as the JSON
fields of a `/predictions` request (`top_k` for a classifier; `score_threshold`,
`iou_threshold`, `max_detections`, `classes` for a detector). The answer:

    {"model_name": ..., "model_version": ..., "id": "42",
     "outputs": [{"name": "labels", "shape": [3], "datatype": "BYTES", "data": [...]}, ...]}

and a refused request gets its own 4xx with `{"error": "<message>"}`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from handlers.errors import ClientError

TensorOutput = dict[str, Any]
BINARY_HEADER = "Inference-Header-Content-Length"
# Request parameters of the protocol itself, not options of the model.
PROTOCOL_PARAMETERS = frozenset({"binary_data_output", "binary_data_size"})


@dataclass(frozen=True)
class V2Request:
    """What the answer needs from a v2 request: its id (None when it sent none)."""

    id: str | None


def is_v2_request(body: object) -> bool:
    """A v2 inference request: a JSON object with an `inputs` member."""
    return isinstance(body, Mapping) and "inputs" in body


def _invalid(message: str) -> ClientError:
    return ClientError(400, "InvalidInferenceRequest", message)


def _single_image(inputs: object) -> str:
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], Mapping):
        raise _invalid("'inputs' must be a list of one input tensor (the image)")
    tensor = inputs[0]
    if tensor.get("datatype") != "BYTES":
        raise _invalid(f"input datatype must be BYTES (a base64 image), got {tensor.get('datatype')!r}")
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape) or math.prod(shape) != 1:
        raise _invalid(f"input shape must hold one element ([1]): one image per request, got {shape!r}")
    data = tensor.get("data")
    while isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, str):
        raise _invalid("input data must be one base64 string")
    return data


def request_fields(body: Mapping[str, Any]) -> tuple[V2Request, dict[str, Any]]:
    """The request's id and its options (`parameters` less the protocol's own); ClientError(400)."""
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise _invalid("'id' must be a string")
    parameters = body.get("parameters", {})
    if not isinstance(parameters, Mapping):
        raise _invalid("'parameters' must be an object")
    if "data" in parameters:
        raise _invalid("'data' is not a parameter; send the image as the input tensor")
    options = {name: value for name, value in parameters.items() if name not in PROTOCOL_PARAMETERS}
    return V2Request(request_id), options


def v2_to_row(body: Mapping[str, Any]) -> tuple[dict[str, Any], V2Request]:
    """A v2 request -> the row a `/predictions` JSON request of the same content would be
    (`{"body": {"data": <base64>, **parameters}}`) and what the answer needs; ClientError(400)."""
    request, options = request_fields(body)
    return {"body": {**options, "data": _single_image(body.get("inputs"))}}, request


def v2_json_in_bytes(body: bytes) -> Mapping[str, Any] | None:
    """A v2 JSON request sent as bytes (no Content-Type), or None when `body` is not one."""
    if body.lstrip()[:1] != b"{":
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if is_v2_request(parsed) else None


def binary_v2_to_row(body: bytes, json_length: str) -> tuple[dict[str, Any], V2Request]:
    """A request in the binary tensor extension -> the row a multipart `/predictions` request of
    the same content would be (`{"data": <image bytes>, **options}`); ClientError(400)."""
    try:
        length = int(json_length)
        parsed = json.loads(body[:length])
    except ValueError:
        raise _invalid(f"{BINARY_HEADER} is {json_length!r} but the body does not start with that "
                       "many bytes of JSON") from None
    if not is_v2_request(parsed):
        raise _invalid("the JSON part must be an inference request with 'inputs'")
    request, options = request_fields(parsed)
    inputs = parsed["inputs"]
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], Mapping):
        raise _invalid("'inputs' must be a list of one input tensor (the image)")
    return {**options, "data": _binary_image(inputs[0], body[length:])}, request


def _binary_image(tensor: Mapping[str, Any], data: bytes) -> bytes:
    size = (tensor.get("parameters") or {}).get("binary_data_size")
    if not isinstance(size, int) or size != len(data):
        raise _invalid(f"the input's binary_data_size ({size!r}) must be the {len(data)} bytes "
                       "after the JSON part")
    shape, datatype = tensor.get("shape"), tensor.get("datatype")
    if datatype == "UINT8":
        if shape != [size]:
            raise _invalid(f"a UINT8 input holds one encoded image: shape [{size}], got {shape!r}")
        return data
    if datatype != "BYTES":
        raise _invalid(f"input datatype must be BYTES or UINT8 (an encoded image), got {datatype!r}")
    if not isinstance(shape, list) or math.prod(shape) != 1:
        raise _invalid(f"input shape must hold one element ([1]): one image per request, got {shape!r}")
    element = int.from_bytes(data[:4], "little")
    if len(data) < 4 or element != len(data) - 4:
        raise _invalid("a BYTES element is a 4-byte little-endian length and that many bytes")
    return data[4:]


def tensor(name: str, datatype: str, shape: Sequence[int], data: Sequence[Any]) -> TensorOutput:
    return {"name": name, "shape": list(shape), "datatype": datatype, "data": list(data)}


def v2_response(model_name: str, model_version: str, request: V2Request,
                outputs: Sequence[TensorOutput]) -> dict[str, Any]:
    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        response["id"] = request.id
    response["outputs"] = list(outputs)
    return response


def v2_error(error: ClientError) -> dict[str, str]:
    return {"error": error.message}


def classification_outputs(scores: Sequence[Mapping[str, Any]]) -> list[TensorOutput]:
    """The top-k of one image as three tensors of shape [k]: labels, probabilities, class ids."""
    k = len(scores)
    return [tensor("labels", "BYTES", [k], [s["label"] for s in scores]),
            tensor("probabilities", "FP32", [k], [s["probability"] for s in scores]),
            tensor("class_ids", "INT64", [k], [s["index"] for s in scores])]


def detection_outputs(detections: Sequence[Mapping[str, Any]]) -> list[TensorOutput]:
    """One image's detections as tensors: boxes [n, 4] (xyxy pixels, row-major), scores [n],
    labels [n], class ids [n]."""
    n = len(detections)
    return [tensor("boxes", "FP32", [n, 4], [c for d in detections for c in d["box"]]),
            tensor("scores", "FP32", [n], [d["score"] for d in detections]),
            tensor("labels", "BYTES", [n], [d["label"] for d in detections]),
            tensor("class_ids", "INT64", [n], [d["index"] for d in detections])]
