"""`server run --front-port`: HAProxy in front of a real TorchServe, with the model endpoints of the
Open Inference Protocol that TorchServe does not route. `tritonclient.http`, unchanged, finds
every call it makes on the front's one address: server and model liveness, readiness and
metadata, and inference, with token authorization on (the production config)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.images import CAT_LABELS, photo_bytes
from tests.server.test_triton_client import image_input, labels
from torchserve_vision import paths
from torchserve_vision.lab.pods import Pod
from torchserve_vision.torchserve_config import free_ports, server_config

pytestmark = pytest.mark.server
CLASSIFIER, DETECTOR = "efficientnet_lite0", "ssdlite320"


@pytest.fixture(scope="module")
def fronted_pod(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    directory = tmp_path_factory.mktemp("front")
    config = server_config(directory, model_store, paths.PRODUCTION_CONFIG,
                           load_models=f"{CLASSIFIER}-1.0.mar,{DETECTOR}-1.0.mar")
    pod = Pod("fronted", config, directory / "run", model_store, drain_delay_s=0.0,
              environment={"TSV_WORKERS": "1", "TSV_TOKEN_AUTHORIZATION": "on"},
              front_port=free_ports(1)[0])
    try:
        pod.start()
        pod.wait_ready()
        yield pod
    finally:
        pod.kill()


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


def test_the_model_endpoints_ask_for_the_key_as_inference_does(fronted_pod: Pod):
    url = f"http://{front_url(fronted_pod)}/v2/models/{CLASSIFIER}"
    assert requests.get(url, timeout=10).status_code == 401
    assert requests.get(url + "/ready", timeout=10).status_code == 401
    refused = requests.post(f"http://{front_url(fronted_pod)}/predictions/{CLASSIFIER}",
                            data=photo_bytes("chelsea.png"), timeout=30)
    assert refused.status_code in (400, 401)            # TorchServe's own answer, passed through
