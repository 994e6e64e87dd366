"""TorchServe's own gRPC inference API (`InferenceAPIsService/Predictions`), called with stubs
generated from the protos in TorchServe's frontend jar, on the session's real server: answers
and per-request options reach the handler, and a request the handler refuses comes back as a
gRPC error status (the frontend agent's doing: TorchServe 0.12 alone answers it with status OK
and the error JSON as the prediction), without failing its batch-mates."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_tools import protoc

from tests.images import CAT_LABELS, load_photo, photo_bytes
from tests.server.http_client import concurrently
from tests.server.load import ContinuousLoad
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.frontend.agent import frontend_jar
from torchserve_vision.lab.compare import register, unregister_all
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.torchserve_config import read_properties
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"
PROTOS = ("inference.proto", "google/rpc/status.proto")


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ModuleType, ModuleType]]:
    """inference_pb2 and inference_pb2_grpc, generated with grpc_tools from TorchServe's protos."""
    directory = tmp_path_factory.mktemp("torchserve_grpc")
    with zipfile.ZipFile(frontend_jar()) as jar:
        for name in PROTOS:
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(jar.read(name))
    include = Path(protoc.__file__).parent / "_proto"
    generated = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{directory}", f"-I{include}",
         f"--python_out={directory}", f"--grpc_python_out={directory}", *PROTOS],
        capture_output=True, text=True, check=False)
    assert generated.returncode == 0, generated.stderr
    sys.path.insert(0, str(directory))
    try:
        yield importlib.import_module("inference_pb2"), importlib.import_module("inference_pb2_grpc")
    finally:
        sys.path.remove(str(directory))


@pytest.fixture(scope="module")
def predict(server: TorchServeInstance, stubs):
    """One Predictions call: (input fields) -> the answer as JSON, or grpc.RpcError."""
    messages, services = stubs
    port = read_properties(server.effective_config)["grpc_inference_port"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = services.InferenceAPIsServiceStub(channel)

        def call(**fields: bytes) -> object:
            reply = client.Predictions(messages.PredictionsRequest(model_name=MODEL, input=fields),
                                       timeout=60)
            return json.loads(reply.prediction)

        yield call


def test_an_answer_and_its_options_reach_the_client(predict):
    answer = predict(data=photo_bytes("chelsea.png"), top_k=b"2")
    assert len(answer) == 2 and answer[0]["label"] in CAT_LABELS


def test_a_refused_request_is_a_grpc_error_with_the_handlers_reason(predict):
    with pytest.raises(grpc.RpcError) as raised:
        predict(data=b"not an image")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert json.loads(raised.value.details().split("\n")[0])["type"] == "NotAnImage"
    with pytest.raises(grpc.RpcError) as too_many:
        predict(data=photo_bytes("chelsea.png"), top_k=b"5000")
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_refused_request_fails_alone_among_concurrent_answers(predict):
    def asking(body: bytes):
        def call() -> object:
            try:
                return predict(data=body)
            except grpc.RpcError as error:
                return error.code()
        return call

    bodies = [photo_bytes("chelsea.png")] * 7
    bodies.insert(3, b"not an image")
    results = concurrently([asking(body) for body in bodies], len(bodies))
    assert results.pop(3) == grpc.StatusCode.INVALID_ARGUMENT
    assert all(isinstance(answer, list) and answer[0]["label"] in CAT_LABELS for answer in results)


def test_a_full_queue_is_unavailable_with_the_queues_message(server, stubs, model_store):
    """With the frontend agent, a request that finds the queue full is refused by the agent's
    queue before TorchServe's own handler answers it (INTERNAL, "has no worker"): UNAVAILABLE,
    saying the queue is full. The detector as a model of its own with a queue of 4, kept full."""
    messages, services = stubs
    port = read_properties(server.effective_config)["grpc_inference_port"]
    detector = "ssd_queue4"
    copy = archive_with_version(model_store, "ssd_mobilenet_v2-1.0.mar", "1.0-queue4",
                                frontend_changes={"jobQueueSize": 4})
    register(server.client(timeout_s=120), model_store, copy, detector, ServingSettings(4, 1, 1, 1))
    try:
        refused = full_queue_refusal(server, messages, services, port, detector)
    finally:
        unregister_all(server.client(), detector)
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert f'Model "{detector}" version 1.0-queue4 has a full queue' in (refused.details() or "")


def full_queue_refusal(server, messages, services, port: str, detector: str) -> grpc.RpcError:
    """The first refusal for a full queue among gRPC predictions sent one after another while 24
    clients keep `detector` busy. A prediction that finds room in the queue is answered, and
    whether the next finds it full depends on how fast the detector empties it on this machine
    (40 tries once all found room), so they are sent until one is refused for it, within a time
    limit that only bounds a broken run."""
    refused: list[grpc.RpcError] = []

    def refused_for_a_full_queue(client) -> bool:
        try:
            client.Predictions(messages.PredictionsRequest(
                model_name=detector, input={"data": load_photo("coffee.png")}), timeout=60)
        except grpc.RpcError as error:
            refused.append(error)
            return "has a full queue" in (error.details() or "")
        return False

    with ContinuousLoad(f"{server.inference_url}/predictions/{detector}", load_photo("coffee.png"),
                        clients=24), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = services.InferenceAPIsServiceStub(channel)
        wait_until(lambda: refused_for_a_full_queue(client), 180,
                   "a gRPC prediction refused for a full queue", interval_s=0.01)
    return refused[-1]
