"""The gRPC front: the Open Inference Protocol's standard gRPC service,
`inference.GRPCInferenceService` (what `tritonclient.grpc` calls), on a port of `server run`,
translated call by call into the same protocol over HTTP on the front (torchserve_vision.front_proxy),
so a gRPC request joins the same batches as HTTP ones and meets the same handlers, limits and
token check. TorchServe 0.12 cannot serve these clients itself: its own Open Inference Protocol
service is declared under another package (`org.pytorch.serve.grpc.openinference`) and its
`ModelInfer` reads only `bytes_contents`, where tritonclient sends `raw_input_contents`.

- ModelInfer: the request becomes a binary-extension body (`Inference-Header-Content-Length`:
  the JSON header, then each input's bytes: `raw_input_contents`, or `bytes_contents` written as
  BYTES elements); `parameters` (the request's options, `timeout` included) and `id` pass as
  they are. The answer's JSON outputs come back as typed tensors in `raw_output_contents` (what
  `InferResult.as_numpy` reads), only those asked for when the request names outputs.
- ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata: the HTTP endpoints of the
  same names (`/v2/health/*`, `/v2`, `/v2/models/{m}[/versions/{v}][/ready]`). An unknown model
  is not ready (Triton's answer), not an error.
- A refused request gets the gRPC status of its HTTP status (400 INVALID_ARGUMENT; 401
  UNAUTHENTICATED, as is TorchServe's 400 for a missing or wrong key; 404 NOT_FOUND; 413 and 429
  RESOURCE_EXHAUSTED; 503 UNAVAILABLE; 504 DEADLINE_EXCEEDED; other INTERNAL) with the handler's
  error message as its details.
- The call's metadata travels as HTTP headers (`authorization` carries the inference key when
  token authorization is on); the call's deadline bounds the HTTP request and travels as its
  `X-Request-Timeout-Ms` (unless the metadata names one), so that a request
  still queued when the client's deadline runs out is answered DEADLINE_EXCEEDED without being
  computed (queued batching's deadlines, docs/configuration.md).
Other methods of the service (model control, statistics, shared memory, model config) answer
UNIMPLEMENTED: TorchServe's management API and the project's command do that work.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np
import requests
from tritonclient.grpc import service_pb2, service_pb2_grpc

from torchserve_vision.front_proxy import FrontError

BINARY_HEADER = "Inference-Header-Content-Length"
DEADLINE_HEADER = "X-Request-Timeout-Ms"
NO_DEADLINE_S = 86_400.0     # a call's remaining time beyond a day is no deadline
T = TypeVar("T")
# Numeric datatypes of the protocol, as little-endian NumPy types; BYTES is length-prefixed.
NUMPY_TYPES = {"BOOL": "?", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
               "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2",
               "FP32": "<f4", "FP64": "<f8"}
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
# Metadata that belongs to the gRPC connection, not to the request.
CONNECTION_METADATA = frozenset({"user-agent", "content-type", "te", "accept-encoding"})


class Refused(Exception):
    """A call the front answers with a non-OK gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


# --- translation, pure --------------------------------------------------------------------------
def bytes_elements(elements: Iterable[bytes]) -> bytes:
    """BYTES tensor data as the protocol lays it out: each element's 4-byte little-endian length,
    then its bytes."""
    return b"".join(struct.pack("<I", len(element)) + element for element in elements)


def parameter_value(parameter: service_pb2.InferParameter) -> bool | int | float | str:
    kind = parameter.WhichOneof("parameter_choice")
    if kind is None:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a parameter has no value")
    return getattr(parameter, kind)


def infer_path(model: str, version: str) -> str:
    return f"/v2/models/{model}/versions/{version}" if version else f"/v2/models/{model}"


def http_infer_request(request: service_pb2.ModelInferRequest) -> tuple[str, dict[str, str], bytes]:
    """(path, headers, body) of the binary-extension HTTP request that asks what `request` asks."""
    if not request.model_name:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "model_name is required")
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    inputs, payloads = [], []
    for index, tensor in enumerate(request.inputs):
        if raw:
            payload = raw[index]
        elif tensor.datatype == "BYTES" and tensor.contents.bytes_contents:
            payload = bytes_elements(tensor.contents.bytes_contents)
        elif tensor.datatype == "UINT8" and tensor.contents.uint_contents:
            payload = bytes(tensor.contents.uint_contents)
        else:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"input {tensor.name!r}: send the images as raw_input_contents or "
                          "bytes_contents (BYTES), or uint_contents (UINT8)")
        inputs.append({"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                       "parameters": {"binary_data_size": len(payload)}})
        payloads.append(payload)
    header: dict[str, Any] = {"inputs": inputs}
    if request.id:
        header["id"] = request.id
    if request.parameters:
        header["parameters"] = {name: parameter_value(value)
                                for name, value in request.parameters.items()}
    encoded = json.dumps(header).encode()
    headers = {BINARY_HEADER: str(len(encoded)), "Content-Type": "application/octet-stream"}
    path = infer_path(request.model_name, request.model_version) + "/infer"
    return path, headers, encoded + b"".join(payloads)


def tensor_bytes(datatype: str, data: Sequence[Any]) -> bytes:
    """An output's JSON data as its raw contents."""
    if datatype == "BYTES":
        return bytes_elements(str(element).encode() if not isinstance(element, bytes) else element
                              for element in data)
    if datatype not in NUMPY_TYPES:
        raise Refused(grpc.StatusCode.INTERNAL, f"the model answered an unknown datatype {datatype!r}")
    return np.asarray(data, dtype=NUMPY_TYPES[datatype]).tobytes()


def infer_response(answer: Mapping[str, Any], requested: Sequence[str]) -> service_pb2.ModelInferResponse:
    """The gRPC answer of the HTTP answer `answer`; only the outputs named in `requested` (all
    when it is empty), in the order the model answered them."""
    response = service_pb2.ModelInferResponse(model_name=str(answer.get("model_name", "")),
                                              model_version=str(answer.get("model_version", "")),
                                              id=str(answer.get("id") or ""))
    outputs = [output for output in answer.get("outputs", [])
               if not requested or output["name"] in requested]
    missing = set(requested) - {output["name"] for output in outputs}
    if missing:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"the model has no output named {', '.join(sorted(missing))}")
    for output in outputs:
        response.outputs.add(name=output["name"], datatype=output["datatype"], shape=output["shape"])
        response.raw_output_contents.append(tensor_bytes(output["datatype"], output["data"]))
    return response


def refusal(status: int, body: bytes) -> Refused:
    """The gRPC status of an HTTP error answer; details: its message (v2 `error`, TorchServe's
    `message`), else its text."""
    code = STATUS_CODES.get(status, grpc.StatusCode.INTERNAL)
    try:
        parsed = json.loads(body)
    except ValueError:
        return Refused(code, body.decode(errors="replace")[:2000] or f"HTTP {status}")
    if isinstance(parsed, Mapping):
        if parsed.get("type") == "InvalidKeyException":   # TorchServe's 400 for a missing/wrong key
            code = grpc.StatusCode.UNAUTHENTICATED
        message = parsed.get("error") or parsed.get("message")
        if isinstance(message, str):
            return Refused(code, message)
    return Refused(code, json.dumps(parsed)[:2000])


def forwarded_headers(metadata: Iterable[tuple[str, str | bytes]]) -> dict[str, str]:
    """The call's metadata that travels as HTTP headers: not gRPC's own, not binary values."""
    return {key: value for key, value in metadata
            if isinstance(value, str) and not key.startswith(("grpc-", ":"))
            and key not in CONNECTION_METADATA}


def deadline_headers(remaining_s: float | None, forwarded: Mapping[str, str]) -> dict[str, str]:
    """{DEADLINE_HEADER: the call's remaining time in whole ms, at least 1} when the call has a
    deadline and its metadata does not already say one (names compared without case); else {}.
    grpcio's server reports a call without a deadline as one about 10^19 s away, so anything
    beyond NO_DEADLINE_S counts as none."""
    if (remaining_s is None or not remaining_s < NO_DEADLINE_S
            or any(name.lower() == DEADLINE_HEADER.lower() for name in forwarded)):
        return {}
    return {DEADLINE_HEADER: str(max(1, math.ceil(remaining_s * 1000)))}


TensorMetadata = service_pb2.ModelMetadataResponse.TensorMetadata


def tensor_metadata(tensors: Sequence[Mapping[str, Any]]) -> list[Any]:
    return [TensorMetadata(
        name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"]) for tensor in tensors]


# --- the service ---------------------------------------------------------------------------------
@dataclass
class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Each call, asked of the HTTP front at `http_url` (one keep-alive session per thread)."""

    http_url: str
    timeout_s: float
    _local: threading.local = field(default_factory=threading.local)

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _call(self, context: grpc.ServicerContext, method: str, path: str,
              headers: Mapping[str, str] | None = None, body: bytes | None = None) -> requests.Response:
        remaining = context.time_remaining()
        timeout = self.timeout_s if remaining is None else max(min(remaining, self.timeout_s), 0.001)
        forwarded = forwarded_headers(context.invocation_metadata())
        sent = {**forwarded, **deadline_headers(remaining, forwarded), **(headers or {})}
        try:
            return self._session().request(method, self.http_url + path, headers=sent, data=body,
                                           timeout=timeout)
        except requests.Timeout as error:
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {timeout:.3g} s") from error
        except requests.RequestException as error:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"the server cannot be reached: {error}") from error

    def _json(self, context: grpc.ServicerContext, path: str) -> Mapping[str, Any]:
        answer = self._call(context, "GET", path)
        if answer.status_code != 200:
            raise refusal(answer.status_code, answer.content)
        return answer.json()

    def _ok(self, context: grpc.ServicerContext, path: str) -> bool:
        """True for a 200, False for another answer (an unknown model is not ready, as Triton
        answers it), a refusal for a missing or wrong key."""
        answer = self._call(context, "GET", path)
        if answer.status_code in (401, 403):
            raise refusal(answer.status_code, answer.content)
        return answer.status_code == 200

    # The protocol's method names.
    def ServerLive(self, request: service_pb2.ServerLiveRequest,
                   context: grpc.ServicerContext) -> service_pb2.ServerLiveResponse:
        return answering(context, lambda: service_pb2.ServerLiveResponse(
            live=self._ok(context, "/v2/health/live")))

    def ServerReady(self, request: service_pb2.ServerReadyRequest,
                    context: grpc.ServicerContext) -> service_pb2.ServerReadyResponse:
        return answering(context, lambda: service_pb2.ServerReadyResponse(
            ready=self._ok(context, "/v2/health/ready")))

    def ModelReady(self, request: service_pb2.ModelReadyRequest,
                   context: grpc.ServicerContext) -> service_pb2.ModelReadyResponse:
        return answering(context, lambda: service_pb2.ModelReadyResponse(
            ready=self._ok(context, infer_path(request.name, request.version) + "/ready")))

    def ServerMetadata(self, request: service_pb2.ServerMetadataRequest,
                       context: grpc.ServicerContext) -> service_pb2.ServerMetadataResponse:
        def metadata() -> service_pb2.ServerMetadataResponse:
            answer = self._json(context, "/v2")
            # TorchServe 0.12 spells the member "extenstion"
            extensions = answer.get("extensions", answer.get("extenstion", []))
            return service_pb2.ServerMetadataResponse(name=str(answer.get("name", "")),
                                                      version=str(answer.get("version", "")),
                                                      extensions=[str(name) for name in extensions])
        return answering(context, metadata)

    def ModelMetadata(self, request: service_pb2.ModelMetadataRequest,
                      context: grpc.ServicerContext) -> service_pb2.ModelMetadataResponse:
        def metadata() -> service_pb2.ModelMetadataResponse:
            answer = self._json(context, infer_path(request.name, request.version))
            return service_pb2.ModelMetadataResponse(
                name=answer["name"], versions=answer.get("versions", []),
                platform=answer.get("platform", ""), inputs=tensor_metadata(answer.get("inputs", [])),
                outputs=tensor_metadata(answer.get("outputs", [])))
        return answering(context, metadata)

    def ModelInfer(self, request: service_pb2.ModelInferRequest,
                   context: grpc.ServicerContext) -> service_pb2.ModelInferResponse:
        def infer() -> service_pb2.ModelInferResponse:
            path, headers, body = http_infer_request(request)
            answer = self._call(context, "POST", path, headers, body)
            if answer.status_code != 200:
                raise refusal(answer.status_code, answer.content)
            return infer_response(answer.json(), [output.name for output in request.outputs])
        return answering(context, infer)


def answering(context: grpc.ServicerContext, work: Callable[[], T]) -> T:
    """`work()`'s answer, or the call aborted with the status of what it refused."""
    try:
        return work()
    except Refused as refused:
        context.abort(refused.code, refused.details)   # raises
        raise


@dataclass
class GrpcFront:
    """The gRPC server, as threads of this process: `with GrpcFront(...)` serves, leaving stops
    (calls in flight get `grace_s` to finish)."""

    host: str
    port: int
    http_url: str
    timeout_s: float
    max_message_bytes: int
    max_workers: int = 64
    grace_s: float = 5.0
    _server: grpc.Server | None = None

    def __enter__(self) -> GrpcFront:
        limits = [("grpc.max_receive_message_length", self.max_message_bytes),
                  ("grpc.max_send_message_length", self.max_message_bytes)]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.max_workers,
                                                        thread_name_prefix="grpc-front"),
                             options=limits)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceService(self.http_url, self.timeout_s), server)
        bound = server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise FrontError(f"the gRPC front cannot listen on {self.host}:{self.port}")
        self.port = bound
        server.start()
        self._server = server
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stop(self.grace_s).wait()
