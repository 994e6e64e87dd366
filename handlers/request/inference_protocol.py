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

A BYTES input of shape [n] carries n images (any mix of sizes and formats); they join the
model's batch with other requests' images, and the answer's outputs lead with the same dimension
n, as Triton's are for a model that batches (shape [1]: outputs [1, k]). Outputs whose shapes
differ from image to image (a detector's boxes) are padded to the largest (BYTES "", numbers 0,
ids -1) and come with `<name>_shapes` (INT64 [n, rank]): each image's own shape. A UINT8 input
is one encoded image and is answered without that dimension. Request `parameters` are the
request's options (but for `timeout`, microseconds: the time the client gives the request, its
deadline, which the frontend agent enforces as it does X-Request-Timeout-Ms), as the JSON fields
of a `/predictions` request (`top_k` for a classifier; `score_threshold`, `iou_threshold`,
`max_detections`, `classes` for a detector). The answer:

    {"model_name": ..., "model_version": ..., "id": "42",
     "outputs": [{"name": "labels", "shape": [1, 3], "datatype": "BYTES", "data": [...]}, ...]}

and a refused request gets its own 4xx with `{"error": "<message>"}`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from handlers.ground.errors import ClientError

TensorOutput = dict[str, Any]
BINARY_HEADER = "Inference-Header-Content-Length"
JSON_OBJECT_START = re.compile(rb"\s*\{")    # what bytes.lstrip() strips, then an object
# Request parameters of the protocol itself, not options of the model.
PROTOCOL_PARAMETERS = frozenset({"binary_data_output", "binary_data_size", "timeout"})


@dataclass(frozen=True)
class V2Request:
    """What the answer needs from a v2 request: its id (None when it sent none), and its
    `timeout` parameter (microseconds, as tritonclient sends it) in seconds: how long the client
    gives the request (None: not said, or 0). The frontend agent reads the same parameter from
    the body and enforces it as the request's deadline before the request reaches a worker
    (torchserve_vision/frontend/ContinuousBatching.java); here it is only checked, so that a
    malformed one is a 400."""

    id: str | None
    timeout_s: float | None = None


def is_v2_request(body: object) -> bool:
    """A v2 inference request: a JSON object with an `inputs` member."""
    return isinstance(body, Mapping) and "inputs" in body


def _invalid(message: str) -> ClientError:
    return ClientError(400, "InvalidInferenceRequest", message)


def _image_tensor(inputs: object) -> Mapping[str, Any]:
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], Mapping):
        raise _invalid("'inputs' must be a list of one input tensor (the images)")
    return inputs[0]


def _image_count(tensor: Mapping[str, Any]) -> int:
    shape = tensor.get("shape")
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(n, int) and n >= 1 for n in shape) or math.prod(shape) != shape[0]):
        raise _invalid(f"input shape must be [n] (n images), got {shape!r}")
    return shape[0]


def _flattened(data: object) -> list[object]:
    if isinstance(data, list):
        return [element for item in data for element in _flattened(item)]
    return [data]


def _json_images(inputs: object) -> list[str]:
    tensor = _image_tensor(inputs)
    if tensor.get("datatype") != "BYTES":
        raise _invalid(f"input datatype must be BYTES (base64 images), got {tensor.get('datatype')!r}")
    count = _image_count(tensor)
    data = _flattened(tensor.get("data"))
    if len(data) != count or not all(isinstance(element, str) for element in data):
        raise _invalid(f"input data must be {count} base64 string(s), as its shape says")
    return [str(element) for element in data]


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
    timeout = parameters.get("timeout", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
        raise _invalid(f"'timeout' is microseconds, a whole number >= 0; got {timeout!r}")
    options = {name: value for name, value in parameters.items() if name not in PROTOCOL_PARAMETERS}
    return V2Request(request_id, timeout / 1e6 if timeout else None), options


def v2_to_row(body: Mapping[str, Any]) -> tuple[dict[str, Any], V2Request]:
    """A v2 request -> the row a JSON request of the same content would be
    (`{"body": {"instances": [<base64>, ...], **parameters}}`) and what the answer needs;
    ClientError(400)."""
    request, options = request_fields(body)
    return {"body": {**options, "instances": _json_images(body.get("inputs"))}}, request


def v2_json_in_bytes(body: bytes | bytearray) -> Mapping[str, Any] | None:
    """A v2 JSON request sent as bytes (no Content-Type), or None when `body` is not one (found
    without copying it: an image's first byte is not `{`)."""
    if JSON_OBJECT_START.match(body) is None:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if is_v2_request(parsed) else None


def binary_v2_to_row(body: bytes | bytearray, json_length: str) -> tuple[dict[str, Any], V2Request]:
    """A request in the binary tensor extension -> the row a multipart request of the same
    content would be (`{"instances": [<image bytes>, ...], **options}`, or `{"data": <image
    bytes>, **options}` for a UINT8 input); ClientError(400). Each image's bytes are copied out
    of `body` once."""
    whole = memoryview(body)
    try:
        length = int(json_length)
        parsed = json.loads(bytes(whole[:length]))
    except ValueError:
        raise _invalid(f"{BINARY_HEADER} is {json_length!r} but the body does not start with that "
                       "many bytes of JSON") from None
    if not is_v2_request(parsed):
        raise _invalid("the JSON part must be an inference request with 'inputs'")
    request, options = request_fields(parsed)
    tensor = _image_tensor(parsed["inputs"])
    data = whole[length:]
    size = (tensor.get("parameters") or {}).get("binary_data_size")
    if not isinstance(size, int) or size != len(data):
        raise _invalid(f"the input's binary_data_size ({size!r}) must be the {len(data)} bytes "
                       "after the JSON part")
    shape, datatype = tensor.get("shape"), tensor.get("datatype")
    if datatype == "UINT8":
        if shape != [size]:
            raise _invalid(f"a UINT8 input holds one encoded image: shape [{size}], got {shape!r}")
        return {**options, "data": bytes(data)}, request
    if datatype != "BYTES":
        raise _invalid(f"input datatype must be BYTES or UINT8 (encoded images), got {datatype!r}")
    return {**options, "instances": _bytes_elements(data, _image_count(tensor))}, request


def _bytes_elements(data: memoryview, count: int) -> list[bytes]:
    """`count` BYTES elements, each a 4-byte little-endian length and that many bytes (copied
    out of `data`)."""
    elements, at = [], 0
    for _ in range(count):
        length = int.from_bytes(data[at:at + 4], "little") if at + 4 <= len(data) else -1
        if length < 0 or at + 4 + length > len(data):
            raise _invalid("a BYTES element is a 4-byte little-endian length and that many bytes")
        elements.append(bytes(data[at + 4:at + 4 + length]))
        at += 4 + length
    if at != len(data):
        raise _invalid(f"{len(data) - at} bytes after the {count} BYTES element(s) the shape says")
    return elements


def tensor(name: str, datatype: str, shape: Sequence[int], data: Sequence[Any]) -> TensorOutput:
    return {"name": name, "shape": list(shape), "datatype": datatype, "data": list(data)}


def v2_response(model_name: str, model_version: str, request: V2Request,
                outputs: Sequence[TensorOutput]) -> dict[str, Any]:
    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        response["id"] = request.id
    response["outputs"] = list(outputs)
    return response


PADDING: dict[str, Any] = {"BYTES": "", "BOOL": False, "INT64": -1, "INT32": -1}


def stacked_outputs(per_image: Sequence[Sequence[TensorOutput]]) -> list[TensorOutput]:
    """The outputs of n images (each image's list, same names in the same order) as tensors
    that lead with n. Where an output's shape differs from image to image it is padded to the
    largest (PADDING; 0 for other types) and `<name>_shapes` (INT64 [n, rank]) follows it."""
    stacked: list[TensorOutput] = []
    for outputs in zip(*per_image, strict=True):
        first = outputs[0]
        shapes = [tuple(output["shape"]) for output in outputs]
        if len(set(shapes)) == 1:
            data = [value for output in outputs for value in output["data"]]
            stacked.append(tensor(first["name"], first["datatype"], [len(outputs), *shapes[0]], data))
            continue
        largest = [max(sizes) for sizes in zip(*shapes, strict=True)]
        pad = PADDING.get(first["datatype"], 0)
        data = [value for output, shape in zip(outputs, shapes, strict=True)
                for value in _padded(list(output["data"]), list(shape), largest, pad)]
        stacked.append(tensor(first["name"], first["datatype"], [len(outputs), *largest], data))
        stacked.append(tensor(f"{first['name']}_shapes", "INT64", [len(outputs), len(largest)],
                              [size for shape in shapes for size in shape]))
    return stacked


def _padded(data: list[Any], shape: list[int], largest: list[int], pad: Any) -> list[Any]:
    """Row-major `data` of `shape` padded to `largest` (same rank)."""
    if len(shape) <= 1:
        return data + [pad] * ((largest[0] if largest else 0) - len(data))
    row = math.prod(shape[1:])
    rows = [_padded(data[i * row:(i + 1) * row], shape[1:], largest[1:], pad) for i in range(shape[0])]
    blank = [pad] * math.prod(largest[1:])
    return [value for part in rows + [blank] * (largest[0] - shape[0]) for value in part]


def v2_error(error: ClientError) -> dict[str, str]:
    return {"error": error.message}


@dataclass(frozen=True)
class OutputSpec:
    """One output tensor as a model's v2 metadata declares it. `shape` is one image's, -1 where it
    depends on the request (a classifier's top_k) or on the image (the boxes found); `ragged`:
    it may differ from image to image within one request, so a request of several images gets
    it padded and followed by `<name>_shapes` (see `stacked_outputs`)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    ragged: bool = False


# Every handler takes encoded images: BYTES of shape [n] (UINT8 of one image: the DALI convention).
IMAGE_INPUT_METADATA: dict[str, Any] = {"name": "image", "datatype": "BYTES", "shape": [-1]}
CLASSIFICATION_OUTPUTS = (OutputSpec("labels", "BYTES", (-1,)),
                          OutputSpec("probabilities", "FP32", (-1,)),
                          OutputSpec("class_ids", "INT64", (-1,)))
DETECTION_OUTPUTS = (OutputSpec("boxes", "FP32", (-1, 4), ragged=True),
                     OutputSpec("scores", "FP32", (-1,), ragged=True),
                     OutputSpec("labels", "BYTES", (-1,), ragged=True),
                     OutputSpec("class_ids", "INT64", (-1,), ragged=True))


def output_metadata(specs: Sequence[OutputSpec]) -> list[dict[str, Any]]:
    """The `outputs` of a model's v2 metadata: each output with the leading dimension of the
    request's images, and `<name>_shapes` after each ragged one."""
    outputs: list[dict[str, Any]] = []
    for spec in specs:
        outputs.append({"name": spec.name, "datatype": spec.datatype, "shape": [-1, *spec.shape]})
        if spec.ragged:
            outputs.append({"name": f"{spec.name}_shapes", "datatype": "INT64",
                            "shape": [-1, len(spec.shape)]})
    return outputs


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
