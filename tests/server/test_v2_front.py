"""`server run --front-port --grpc-front-port`: HAProxy in front of a real TorchServe, with the model
endpoints of the Open Inference Protocol that TorchServe does not route, and the protocol's
standard gRPC service translated onto it. `tritonclient.http` and `tritonclient.grpc`, unchanged,
find every call they make on one address each: server and model liveness, readiness and
metadata, and inference, with token authorization on (the production config)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.images import CAT_LABELS, photo_bytes, slow_png
from tests.server.http_client import concurrently
from tests.server.load import ContinuousLoad
from tests.server.test_triton_client import image_input, labels
from torchserve_vision import paths
from torchserve_vision.lab.pods import Pod
from torchserve_vision.prometheus_text import scrape, total
from torchserve_vision.server_state import ready_workers
from torchserve_vision.torchserve_config import free_ports, read_properties, server_config
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
CLASSIFIER, DETECTOR = "efficientnet_lite0", "ssd_mobilenet_v2"


@pytest.fixture(scope="module")
def fronted_pod(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    directory = tmp_path_factory.mktemp("front")
    config = server_config(directory, model_store, paths.PRODUCTION_CONFIG,
                           load_models=f"{CLASSIFIER}-1.0.mar,{DETECTOR}-1.0.mar")
    front_port, grpc_front_port = free_ports(2)
    pod = Pod("fronted", config, directory / "run", model_store, drain_delay_s=0.0,
              environment={"TSV_WORKERS": "1", "TSV_TOKEN_AUTHORIZATION": "on"},
              front_port=front_port, grpc_front_port=grpc_front_port)
    with pod.running():
        yield pod


def front_url(pod: Pod) -> str:
    return f"127.0.0.1:{pod.front_port}"


@pytest.fixture
def client(fronted_pod: Pod) -> triton.InferenceServerClient:
    """A tritonclient on the front, with the inference key as TorchServe asks for it."""
    return triton.InferenceServerClient(front_url(fronted_pod))


@pytest.fixture
def key(fronted_pod: Pod) -> dict[str, str]:
    return fronted_pod.instance.inference_headers()


def test_the_server_and_each_model_are_live_and_ready(client, key):
    assert client.is_server_live(headers=key) and client.is_server_ready(headers=key)
    assert client.is_model_ready(CLASSIFIER, headers=key)
    assert client.is_model_ready(DETECTOR, model_version="1.0", headers=key)
    assert not client.is_model_ready("no_such_model", headers=key)
    assert not client.is_model_ready(CLASSIFIER, model_version="9.9", headers=key)


def test_model_metadata_tells_the_truth_about_inputs_and_outputs(client, key):
    metadata = client.get_model_metadata(CLASSIFIER, headers=key)
    assert metadata["name"] == CLASSIFIER and metadata["versions"] == ["1.0"]
    assert metadata["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1]}]
    outputs = {output["name"]: output for output in metadata["outputs"]}
    assert {name: (o["datatype"], o["shape"]) for name, o in outputs.items()} == {
        "labels": ("BYTES", [-1, -1]), "probabilities": ("FP32", [-1, -1]),
        "class_ids": ("INT64", [-1, -1])}
    detector = {o["name"]: o["shape"] for o in client.get_model_metadata(DETECTOR, headers=key)["outputs"]}
    assert detector["boxes"] == [-1, -1, 4] and detector["boxes_shapes"] == [-1, 2]
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("no_such_model", headers=key)
    assert raised.value.status() == "404"


def test_inference_goes_through_the_front_unchanged(client, key):
    result = client.infer(CLASSIFIER, [image_input(photo_bytes("chelsea.png"))],
                          parameters={"top_k": 3}, headers=key)
    assert labels(result)[0][0] in CAT_LABELS and result.as_numpy("probabilities").shape == (1, 3)
    boxes = client.infer(DETECTOR, [image_input(photo_bytes("astronaut.png"))],
                         parameters={"max_detections": 2, "score_threshold": 0.0}, headers=key)
    assert boxes.as_numpy("boxes").shape == (1, 2, 4)
    assert np.isfinite(boxes.as_numpy("scores")).all()


def test_a_version_is_served_by_name_over_http_and_grpc(client, key, grpc_client, grpc_key):
    """TorchServe alone answers /v2/models/{m}/versions/{v}/infer with 501; the front serves it."""
    photo = photo_bytes("chelsea.png")
    result = client.infer(CLASSIFIER, [image_input(photo)], model_version="1.0", headers=key)
    assert result.get_response()["model_version"] == "1.0" and labels(result)[0][0] in CAT_LABELS
    over_grpc = grpc_client.infer(CLASSIFIER, [grpc_image(photo)], model_version="1.0", headers=grpc_key)
    assert over_grpc.get_response().model_version == "1.0"
    with pytest.raises(InferenceServerException) as unknown:
        client.infer(CLASSIFIER, [image_input(photo)], model_version="9.9", headers=key)
    assert unknown.value.status() == "404"
    with pytest.raises(InferenceServerException) as unknown_over_grpc:
        grpc_client.infer(CLASSIFIER, [grpc_image(photo)], model_version="9.9", headers=grpc_key)
    assert unknown_over_grpc.value.status() == "StatusCode.NOT_FOUND"


def test_the_model_endpoints_ask_for_the_key_as_inference_does(fronted_pod: Pod):
    url = f"http://{front_url(fronted_pod)}/v2/models/{CLASSIFIER}"
    assert requests.get(url, timeout=10).status_code == 401
    assert requests.get(url + "/ready", timeout=10).status_code == 401
    refused = requests.post(f"http://{front_url(fronted_pod)}/predictions/{CLASSIFIER}",
                            data=photo_bytes("chelsea.png"), timeout=30)
    assert refused.status_code in (400, 401)            # TorchServe's own answer, passed through


# --- the gRPC front: tritonclient.grpc ----------------------------------------------------------
@pytest.fixture
def grpc_client(fronted_pod: Pod) -> Iterator[triton_grpc.InferenceServerClient]:
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{fronted_pod.grpc_front_port}") as client:
        yield client


@pytest.fixture
def grpc_key(key: dict[str, str]) -> dict[str, str]:
    """The key as gRPC metadata (whose names are lower case)."""
    return {name.lower(): value for name, value in key.items()}


def grpc_image(image: bytes, datatype: str = "BYTES") -> triton_grpc.InferInput:
    if datatype == "UINT8":
        tensor = triton_grpc.InferInput("image", [len(image)], "UINT8")
        tensor.set_data_from_numpy(np.frombuffer(image, dtype=np.uint8))
        return tensor
    tensor = triton_grpc.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    return tensor


def grpc_labels(result: triton_grpc.InferResult) -> list[list[str]]:
    return [[value.decode() for value in row] for row in result.as_numpy("labels").tolist()]


def test_grpc_health_readiness_and_metadata(grpc_client, grpc_key):
    assert grpc_client.is_server_live(headers=grpc_key) and grpc_client.is_server_ready(headers=grpc_key)
    assert grpc_client.is_model_ready(CLASSIFIER, headers=grpc_key)
    assert grpc_client.is_model_ready(DETECTOR, model_version="1.0", headers=grpc_key)
    assert not grpc_client.is_model_ready("no_such_model", headers=grpc_key)
    server = grpc_client.get_server_metadata(headers=grpc_key)
    assert server.version == "0.12.0" and "kserve" in server.extensions
    metadata = grpc_client.get_model_metadata(CLASSIFIER, headers=grpc_key, as_json=True)
    assert metadata["versions"] == ["1.0"]
    assert metadata["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": ["-1"]}]
    assert {output["name"]: output["datatype"] for output in metadata["outputs"]} == {
        "labels": "BYTES", "probabilities": "FP32", "class_ids": "INT64"}
    with pytest.raises(InferenceServerException) as raised:
        grpc_client.get_model_metadata("no_such_model", headers=grpc_key)
    assert raised.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize("datatype", ["BYTES", "UINT8"])
def test_grpc_inference_gives_the_http_answer(grpc_client, grpc_key, client, key, datatype):
    photo = photo_bytes("chelsea.png")
    result = grpc_client.infer(CLASSIFIER, [grpc_image(photo, datatype)], request_id="g1",
                               parameters={"top_k": 3}, headers=grpc_key)
    over_http = client.infer(CLASSIFIER, [image_input(photo, datatype)], parameters={"top_k": 3},
                             headers=key)
    assert result.get_response().id == "g1"
    found = [label.decode() for label in result.as_numpy("labels").reshape(-1)]  # BYTES as bytes
    assert found == [str(label) for label in over_http.as_numpy("labels").reshape(-1)]
    assert found[0] in CAT_LABELS
    assert result.as_numpy("class_ids").dtype == np.int64
    np.testing.assert_array_equal(result.as_numpy("probabilities"), over_http.as_numpy("probabilities"))
    assert result.as_numpy("probabilities").shape == ((1, 3) if datatype == "BYTES" else (3,))


def test_a_grpc_calls_deadline_travels_as_the_requests_deadline(grpc_client, grpc_key):
    """The front sends a call's deadline as X-Request-Timeout-Ms, which the frontend agent reads
    (a malformed one would be a 400, INVALID_ARGUMENT): with one the call is answered as without;
    a deadline header of the caller's own that is not a whole number is refused by the agent."""
    photo = photo_bytes("chelsea.png")
    result = grpc_client.infer(CLASSIFIER, [grpc_image(photo)], headers=grpc_key, client_timeout=30)
    assert result.as_numpy("labels").reshape(-1)[0].decode() in CAT_LABELS
    with pytest.raises(InferenceServerException) as refused:
        grpc_client.infer(CLASSIFIER, [grpc_image(photo)], client_timeout=30,
                          headers={**grpc_key, "x-request-timeout-ms": "soon"})
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "X-Request-Timeout-Ms" in refused.value.message()


AN_HOUR_US = 3_600_000_000


def expired_requests(pod: Pod) -> float:
    return total(scrape(pod.instance.metrics_url), "ts_requests_expired_total", model_name=CLASSIFIER)


def test_a_v2_timeout_parameter_is_the_requests_deadline_over_http_and_grpc(
        fronted_pod, client, key, grpc_client, grpc_key):
    """tritonclient's `timeout` (microseconds, in the request's parameters) is the request's
    deadline, by the rule of X-Request-Timeout-Ms (the frontend agent reads it from the body):
    once the one worker has run a batch, its recent batch time is over 1 ms, so 1 us (1 ms,
    rounded up) cannot be met: 504 (gRPC: DEADLINE_EXCEEDED), counted as expired, never
    computed; an hour is answered."""
    photo = photo_bytes("chelsea.png")
    # tritonclient adds its binary header to the dict it is given: a fresh copy per call.
    answered = client.infer(CLASSIFIER, [image_input(photo, "BYTES", True)], headers=dict(key),
                            timeout=AN_HOUR_US)
    assert labels(answered)[0][0] in CAT_LABELS
    before = expired_requests(fronted_pod)
    with pytest.raises(InferenceServerException) as refused:
        client.infer(CLASSIFIER, [image_input(photo, "BYTES", True)], headers=dict(key), timeout=1)
    assert refused.value.status() == "504" and "deadline" in refused.value.message()
    over_grpc = grpc_client.infer(CLASSIFIER, [grpc_image(photo)], headers=dict(grpc_key),
                                  timeout=AN_HOUR_US)
    assert over_grpc.as_numpy("labels").reshape(-1)[0].decode() in CAT_LABELS
    with pytest.raises(InferenceServerException) as refused_grpc:
        grpc_client.infer(CLASSIFIER, [grpc_image(photo)], headers=dict(grpc_key), timeout=1)
    assert refused_grpc.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert expired_requests(fronted_pod) == before + 2


def test_grpc_several_images_and_asked_outputs_of_the_detector(grpc_client, grpc_key):
    images = np.array([photo_bytes("astronaut.png"), photo_bytes("chelsea.png")], dtype=np.object_)
    tensor = triton_grpc.InferInput("image", [2], "BYTES")
    tensor.set_data_from_numpy(images)
    asked = [triton_grpc.InferRequestedOutput("boxes"), triton_grpc.InferRequestedOutput("scores")]
    result = grpc_client.infer(DETECTOR, [tensor], outputs=asked, headers=grpc_key,
                               parameters={"max_detections": 3, "score_threshold": 0.0})
    assert [output.name for output in result.get_response().outputs] == ["boxes", "scores"]
    assert result.as_numpy("boxes").shape == (2, 3, 4) and result.as_numpy("scores").shape == (2, 3)
    assert not np.array_equal(result.as_numpy("boxes")[0], result.as_numpy("boxes")[1])


def test_grpc_refusals_are_statuses_with_the_handlers_reason(grpc_client, grpc_key):
    with pytest.raises(InferenceServerException) as unauthenticated:
        grpc_client.infer(CLASSIFIER, [grpc_image(photo_bytes("chelsea.png"))])
    assert unauthenticated.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as unknown:
        grpc_client.infer("no_such_model", [grpc_image(photo_bytes("chelsea.png"))], headers=grpc_key)
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as too_many:
        grpc_client.infer(CLASSIFIER, [grpc_image(photo_bytes("chelsea.png"))],
                          parameters={"top_k": 5000}, headers=grpc_key)
    assert too_many.value.status() == "StatusCode.INVALID_ARGUMENT" and "top_k" in too_many.value.message()

    def asking(body: bytes):
        def call() -> object:
            try:
                return grpc_labels(grpc_client.infer(CLASSIFIER, [grpc_image(body)], headers=grpc_key))
            except InferenceServerException as error:
                return error.status(), error.message()
        return call

    bodies = [photo_bytes("chelsea.png")] * 7
    bodies.insert(3, b"not an image")
    answers = concurrently([asking(body) for body in bodies], len(bodies))
    status, message = answers.pop(3)
    assert status == "StatusCode.INVALID_ARGUMENT" and "text" in message
    assert all(answer[0][0] in CAT_LABELS for answer in answers)


FULL_QUEUE = re.compile(rf'Model "{DETECTOR}" version 1\.0 has a full queue: (\d+) requests are waiting')
Answer = tuple[int, str, str | None]      # status, message, Retry-After


def production_delay_bound_ms() -> int:
    """The production profile's bound on every model's queueing delay (max_queueing_delay_ms)."""
    return int(read_properties(paths.PRODUCTION_CONFIG)["max_queueing_delay_ms"])


def refused_while_full(send: Callable[[], Answer], attempts: int = 40) -> tuple[str, str | None]:
    """Send until the answer is the full queue's refusal (a request may slip into a place a
    batch just freed): its message and Retry-After."""
    for _ in range(attempts):
        status, message, retry_after = send()
        if status == 503 and FULL_QUEUE.search(message):
            return message, retry_after
    raise AssertionError(f"no full-queue refusal in {attempts} requests; the last: {status} {message}")


def test_a_full_queue_says_so_with_retry_after_to_every_client(fronted_pod, client, key, grpc_client,
                                                               grpc_key):
    """The detector's queue kept full (the production profile's: as long as its worker takes
    max_queueing_delay_ms to reach) by 48 clients sending a slow PNG straight to TorchServe (with
    batches of 4 of them taking about the bound, more than the 8 in the two workers' batches must
    wait to pass it, and every refused client sits out `refusal_hold_ms`),
    then requests of each client through the front: a refusal names the model, its version,
    the requests waiting and the bound, with a Retry-After in seconds; the gRPC front's is
    UNAVAILABLE with the same message. Each refusal is counted."""
    url = f"http://{front_url(fronted_pod)}/predictions/{DETECTOR}"
    photo = photo_bytes("coffee.png")
    metrics = fronted_pod.instance.metrics_url
    refused_before = total(scrape(metrics), "ts_requests_refused_queue_full_total", model_name=DETECTOR)

    def rest() -> Answer:
        answer = requests.post(url, data=photo, headers={**key, "Content-Type": "image/png"}, timeout=60)
        message = answer.json().get("message", "") if answer.status_code != 200 else ""
        return answer.status_code, message, answer.headers.get("Retry-After")

    def v2_http() -> Answer:
        try:   # a copy: tritonclient adds its binary header, an int, to the dict it is given
            client.infer(DETECTOR, [image_input(photo)], headers=dict(key))
        except InferenceServerException as error:
            return int(error.status() or 0), error.message() or "", None
        return 200, "", None

    def v2_grpc() -> Answer:
        try:
            grpc_client.infer(DETECTOR, [grpc_image(photo)], headers=grpc_key)
        except InferenceServerException as error:
            return (503 if error.status() == "StatusCode.UNAVAILABLE" else 0), error.message() or "", None
        return 200, "", None

    def curl() -> Answer:
        done = subprocess.run(["curl", "-s", "-i", "-H", f"Authorization: {key['Authorization']}",
                               "-H", "Content-Type: image/png", "--data-binary", "@-", url],
                              input=photo, capture_output=True, check=True, timeout=60)
        head, _, body = done.stdout.decode().partition("\r\n\r\n")
        status = int(head.split()[1])
        retry = re.search(r"^Retry-After: (\d+)", head, re.M | re.I)
        message = json.loads(body).get("message", "") if status != 200 else ""
        return status, message, retry.group(1) if retry else None

    filling = f"{fronted_pod.instance.inference_url}/predictions/{DETECTOR}"
    with ContinuousLoad(filling, slow_png(), clients=48, headers=lambda: dict(key), pause_s=0.05) as load:
        message, retry_after = refused_while_full(rest)
        assert retry_after is not None and int(retry_after) >= 1
        found = FULL_QUEUE.search(message)
        assert found is not None and int(found.group(1)) > 0
        assert f"over the server's max_queueing_delay_ms of {production_delay_bound_ms()} ms" in message
        assert f"retry after {retry_after} s" in message
        for send in (v2_http, v2_grpc):
            assert FULL_QUEUE.search(refused_while_full(send)[0])
        curled, curl_retry = refused_while_full(curl)
        assert curl_retry is not None and FULL_QUEUE.search(curled)
    assert {outcome.status for outcome in load.outcomes} <= {200, 503}, "the load itself failed"
    refused = total(scrape(metrics), "ts_requests_refused_queue_full_total", model_name=DETECTOR)
    assert refused - refused_before >= 4


def test_a_version_with_no_worker_keeps_torchserves_own_message(fronted_pod, key):
    management = fronted_pod.instance.client()
    url = f"http://{front_url(fronted_pod)}/predictions/{DETECTOR}"
    management.scale(DETECTOR, "1.0", 0, 0)
    try:
        wait_until(lambda: ready_workers(management.describe(DETECTOR, None)[0]) == 0, 60, "no worker")
        answer = requests.post(url, data=photo_bytes("coffee.png"), timeout=60,
                               headers={**key, "Content-Type": "image/png"})
        message = answer.json()["message"]
        assert answer.status_code == 503 and "has no worker" in message and not FULL_QUEUE.search(message)
    finally:
        management.scale(DETECTOR, "1.0", 1, 1)
        wait_until(lambda: ready_workers(management.describe(DETECTOR, None)[0]) == 1, 120,
                   "the detector's worker")
