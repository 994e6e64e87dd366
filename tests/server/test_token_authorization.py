"""The commands (models, predict, lab load) against a TorchServe with token authorization on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.images import PHOTOS_DIR, photo_bytes
from tests.server.servers import started_server
from torchserve_vision.cli import main as command
from torchserve_vision.client import KeyFile, TorchServeClient
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.torchserve_config import read_properties

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"


@pytest.fixture(scope="module")
def secured_server(model_store: Path, tmp_path_factory) -> Iterator[TorchServeInstance]:
    yield from started_server(tmp_path_factory.mktemp("secured"), model_store,
                              load_models="efficientnet_lite0-1.0.mar",
                              disable_token_authorization="false")


def cli(server: TorchServeInstance, *args: str) -> int:
    return command(["models", *args, "--management-url", server.management_url,
                    "--inference-url", server.inference_url, "--metrics-url", server.metrics_url,
                    "--key-file", str(server.key_file),
                    "--model-store", str(Path(read_properties(server.config_path)["model_store"]))])


def keys(server: TorchServeInstance) -> dict:
    return json.loads(server.key_file.read_text())


def test_calls_without_a_valid_key_are_refused(secured_server):
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        answer = requests.get(f"{secured_server.management_url}/models", headers=headers, timeout=30)
        assert answer.status_code == 400 and answer.json()["type"] == "InvalidKeyException"
        inference = requests.post(f"{secured_server.inference_url}/predictions/{MODEL}", timeout=30,
                                  data=photo_bytes("coffee.png"), headers=headers)
        assert inference.status_code == 400
    management_key = keys(secured_server)["management"]["key"]
    wrong_kind = requests.post(f"{secured_server.inference_url}/predictions/{MODEL}", timeout=30,
                               data=photo_bytes("coffee.png"),
                               headers={"Authorization": f"Bearer {management_key}"})
    assert wrong_kind.status_code == 400


def test_model_commands_work_with_the_key_file(secured_server, capsys):
    assert cli(secured_server, "describe", MODEL, "--json") == 0
    assert json.loads(capsys.readouterr().out)[0]["modelVersion"] == "1.0"
    assert cli(secured_server, "scale", MODEL, "--min", "2", "--max", "2") == 0
    assert cli(secured_server, "scale", MODEL, "--workers", "1") == 0
    client = TorchServeClient(secured_server.management_url, secured_server.inference_url,
                              KeyFile(secured_server.key_file))
    assert client.predict(MODEL, None, photo_bytes("coffee.png"))[0]["label"] == "espresso"


def test_an_expired_key_is_refreshed(secured_server, capsys):
    document = keys(secured_server)
    old_key = document["management"]["key"]
    document["management"]["expiration time"] = "2000-01-01T00:00:00.000Z"
    secured_server.key_file.write_text(json.dumps(document))
    assert cli(secured_server, "list") == 0
    assert keys(secured_server)["management"]["key"] != old_key
    assert "efficientnet_lite0 1.0" in capsys.readouterr().out


def test_a_key_the_server_no_longer_accepts_is_refreshed_and_the_call_retried(secured_server):
    document = keys(secured_server)
    document["management"]["key"] = "stale123"
    secured_server.key_file.write_text(json.dumps(document))
    client = TorchServeClient(secured_server.management_url, secured_server.inference_url,
                              KeyFile(secured_server.key_file))
    assert client.list_models()[0]["modelName"] == MODEL
    assert keys(secured_server)["management"]["key"] != "stale123"


def test_without_the_key_file_the_commands_fail_with_the_servers_message(secured_server, capsys):
    code = command(["models", "list", "--management-url", secured_server.management_url])
    assert code == 1
    assert "InvalidKeyException" in capsys.readouterr().err


def test_predict_and_load_reach_a_server_with_tokens_on(secured_server, capsys, tmp_path):
    connection = ["--inference-url", secured_server.inference_url, "--key-file", str(secured_server.key_file)]
    assert command(["predict", str(PHOTOS_DIR / "coffee.png"), "--json", *connection]) == 0
    assert json.loads(capsys.readouterr().out)[0]["label"] == "espresso"
    assert command(["lab", "load", "--clients", "2", "--duration", "1", "--json", *connection]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sent"] > 0 and report["succeeded"] == report["sent"], report
    assert command(["predict", str(PHOTOS_DIR / "coffee.png"),
                    "--inference-url", secured_server.inference_url]) == 1
    assert "token authorization on: give --key-file" in capsys.readouterr().err
    stale = tmp_path / "key_file.json"
    stale.write_text(json.dumps({kind: {**entry, "key": "stale"} if isinstance(entry, dict) else entry
                                 for kind, entry in keys(secured_server).items()}))
    assert command(["predict", str(PHOTOS_DIR / "coffee.png"), "--key-file", str(stale),
                    "--inference-url", secured_server.inference_url,
                    "--management-url", secured_server.management_url]) == 1
    assert "refused the keys" in capsys.readouterr().err
