"""config/config.production.properties on a real TorchServe: what it refuses, and what works."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.images import photo_bytes
from tests.server.servers import started_server
from torchserve_vision import paths
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.cli import main as command
from torchserve_vision.prometheus_text import total
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.torchserve_config import read_properties
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server


CANDIDATE = "2.0-production"


@pytest.fixture(scope="module")
def production_server(model_store: Path, tmp_path_factory) -> Iterator[TorchServeInstance]:
    """The production config with two versions of the classifier loaded at start: the way a
    candidate gets onto a server whose model API is off (nothing can be registered later)."""
    candidate = archive_with_version(model_store, "efficientnet_lite0-1.0.mar", CANDIDATE)
    yield from started_server(tmp_path_factory.mktemp("production"), model_store,
                              base_config=paths.PRODUCTION_CONFIG,
                              load_models=f"efficientnet_lite0-1.0.mar,{candidate}")


def connection_to(server: TorchServeInstance, store: Path, history: Path) -> list[str]:
    """The `models` command's options for this server, with its key file."""
    return ["--management-url", server.management_url, "--inference-url", server.inference_url,
            "--key-file", str(server.key_file), "--model-store", str(store),
            "--history", str(history)]


def test_the_production_config_says_what_it_should():
    properties = read_properties(paths.PRODUCTION_CONFIG)
    assert properties["disable_token_authorization"] == "false"
    assert properties["enable_model_api"] == "false"
    assert all(properties[key].startswith("http://127.0.0.1:")
               for key in ("inference_address", "management_address", "metrics_address"))
    assert properties["max_request_size"] == "6553500"
    assert properties["allowed_urls"].startswith("file://MODEL_STORE_PATH/")  # written at start


def test_the_server_runs_with_allowed_urls_restricted_to_its_own_model_store(production_server,
                                                                            model_store):
    effective = read_properties(production_server.effective_config)
    assert effective["allowed_urls"] == f"file://\\\\Q{model_store.resolve()}\\\\E/[^/]+\\\\.mar"
    assert effective["model_store"] == str(model_store.resolve())


def test_registering_and_deleting_models_answer_405(production_server):
    headers = production_server.management_headers()
    for url in ("efficientnet_lite0-1.0.mar", "file:///etc/passwd", "http://127.0.0.1:9/x.mar"):
        answer = requests.post(f"{production_server.management_url}/models", params={"url": url},
                               headers=headers, timeout=30)
        assert answer.status_code == 405, (url, answer.text)
    deleted = requests.delete(f"{production_server.management_url}/models/efficientnet_lite0/1.0",
                              headers=headers, timeout=30)
    assert deleted.status_code == 405


def test_inference_without_the_token_is_refused_and_with_it_served(production_server):
    inference = f"{production_server.inference_url}/predictions/efficientnet_lite0"
    refused = requests.post(inference, data=photo_bytes("coffee.png"), timeout=30,
                            headers={"Content-Type": "image/png"})
    assert refused.status_code == 400 and refused.json()["type"] == "InvalidKeyException"
    served = requests.post(inference, data=photo_bytes("coffee.png"), timeout=30,
                           headers={"Content-Type": "image/png", **production_server.inference_headers()})
    assert served.status_code == 200 and served.json()[0]["label"] == "espresso"


def test_scaling_and_describing_still_work_with_the_management_key(production_server):
    headers = production_server.management_headers()
    base = f"{production_server.management_url}/models/efficientnet_lite0"
    assert requests.get(base, timeout=30).status_code == 400  # no key
    assert requests.get(base, headers=headers, timeout=30).json()[0]["modelVersion"] == "1.0"
    scaled = requests.put(base, params={"min_worker": "1", "max_worker": "1", "synchronous": "true"},
                          headers=headers, timeout=60)
    assert scaled.status_code == 200


def test_a_candidate_loaded_at_start_is_shadowed_with_the_model_api_off(production_server,
                                                                       model_store):
    """`models shadow` registers nothing when the candidate is there already: with token
    authorization on, the workers send their copies with the current inference key."""
    connection = connection_to(production_server, model_store,
                               production_server.run_dir / "history.json")
    shadow = ["models", "shadow", "efficientnet_lite0"]
    assert command([*shadow, f"efficientnet_lite0-{CANDIDATE}.mar", "--percent", "100",
                    *connection]) == 0
    headers = {"Content-Type": "image/png", **production_server.inference_headers()}
    answers = [requests.post(f"{production_server.inference_url}/predictions/efficientnet_lite0",
                             data=photo_bytes("coffee.png"), headers=headers, timeout=30)
               for _ in range(5)]
    assert {(a.status_code, a.headers["X-Model-Version"]) for a in answers} == {(200, "1.0")}

    def compared() -> float:
        text = requests.get(f"{production_server.metrics_url}/metrics", timeout=10).text
        return total(text, "HandlerShadowCompared", Candidate=CANDIDATE)

    wait_until(lambda: compared() >= 5, 30, "five copies compared")
    assert command([*shadow, "--off", *connection]) == 0


def test_scaling_the_default_down_is_refused_before_any_change(production_server, model_store,
                                                                capsys):
    """Scaling the default version down without a failed request registers a copy of its archive
    with fewer workers, which the model API being off forbids: the command says so and changes
    nothing (no copy registered, the workers as they were, nothing recorded)."""
    history = production_server.run_dir / "scaling-history.json"
    connection = connection_to(production_server, model_store, history)
    assert command(["models", "scale", "efficientnet_lite0", "--min", "2", "--max", "2",
                    *connection]) == 0
    capsys.readouterr()
    assert command(["models", "scale", "efficientnet_lite0", "--workers", "1", *connection]) == 1
    said = capsys.readouterr()
    assert "model API is off" in said.err and "nothing was changed" in said.err, said.err
    assert "registering" not in said.out, said.out
    headers = production_server.management_headers()
    described = requests.get(f"{production_server.management_url}/models/efficientnet_lite0/all",
                             headers=headers, timeout=30).json()
    assert {d["modelVersion"] for d in described} == {"1.0", CANDIDATE}
    assert [len(d["workers"]) for d in described if d["modelVersion"] == "1.0"] == [2]
    assert [entry["kind"] for entry in json.loads(history.read_text())] == ["scale"]
    scaled = requests.put(f"{production_server.management_url}/models/efficientnet_lite0/1.0",
                          params={"min_worker": "1", "max_worker": "1", "synchronous": "true"},
                          headers=headers, timeout=60)
    assert scaled.status_code == 200
