"""Start-up on a real TorchServe: timeouts from config/models.yaml, workers that report their
start-up time and run the compiled package, and an archive compiled for another target that is
refused by the worker and served eagerly instead of crashing it."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import requests
import yaml

from tests.images import CAT_LABELS, photo_bytes
from tests.server.http_client import post_image
from tests.server.logs import wait_for_log
from torchserve_vision import paths
from torchserve_vision.model_descriptions import load_descriptions
from torchserve_vision.server_process import TorchServeInstance

pytestmark = pytest.mark.server
READY_LINE = re.compile(r"worker ready model=(\S+) version=(\S+) device=\S+ runner=(\S+) .*"
                        r"startup_ms=(\d+)")


def describe(server: TorchServeInstance, model: str, version: str | None = None) -> dict:
    path = f"{model}/{version}" if version else model
    return requests.get(f"{server.management_url}/models/{path}", timeout=30).json()[0]


def started_descriptions():
    return [d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.start]


def test_each_model_has_the_timeouts_of_its_description(server):
    for description in started_descriptions():
        described = describe(server, description.name)
        assert described["startupTimeout"] == description.serving.startup_timeout_s
        assert described["responseTimeout"] == description.serving.response_timeout_s


def test_workers_log_their_start_up_time_and_the_classifier_runs_its_compiled_package(server):
    expected_workers = {d.name: d.serving.min_workers for d in started_descriptions()}

    def ready_lines(lines: list[str]) -> list[re.Match[str]]:
        return [match for line in lines if (match := READY_LINE.search(line))]

    lines = wait_for_log(server.log_dir / "model_log.log",
                         lambda lines: len(ready_lines(lines)) >= sum(expected_workers.values()))
    ready = ready_lines(lines)
    for name, workers in expected_workers.items():
        assert sum(match[1] == name for match in ready) >= workers, name
    assert {match[3] for match in ready if match[1] == "efficientnet_lite0"} == {"aot"}
    assert all(int(match[4]) > 0 for match in ready)


def copy_with_foreign_target(source: Path, target: Path, model_name: str) -> None:
    """The archive under another model name, its compiled packages recorded as built with
    another torch: a worker must refuse them."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for item in old.infolist():
            data = old.read(item.filename)
            if item.filename == "model-config.yaml":
                config = yaml.safe_load(data)
                for package in config["handler"]["compiled_packages"]:
                    package["target"]["torch_version"] = "1.0.0"
                data = yaml.safe_dump(config).encode()
            elif item.filename == "MAR-INF/MANIFEST.json":
                data = data.replace(b'"efficientnet_lite0"', f'"{model_name}"'.encode())
            new.writestr(item, data)


def test_an_archive_compiled_for_another_target_is_served_eagerly(server, model_store):
    name = "lite0_foreign_target"
    copy_with_foreign_target(model_store / "efficientnet_lite0-1.0.mar", model_store / f"{name}.mar",
                             name)
    registered = requests.post(f"{server.management_url}/models", timeout=120,
                               params={"url": f"{name}.mar", "initial_workers": "1", "synchronous": "true"})
    assert registered.status_code == 200, registered.text
    try:
        assert describe(server, name)["workers"][0]["status"] == "READY"
        reply = post_image(f"{server.inference_url}/predictions/{name}", photo_bytes("chelsea.png"))
        assert reply.status == 200 and reply.body[0]["label"] in CAT_LABELS
        lines = wait_for_log(server.log_dir / "model_log.log",
                             lambda lines: any(f"model={name} " in line for line in lines))
        assert any(f"model={name} " in line and "runner=eager" in line for line in lines)
        assert any("compiled model refused (target)" in line and "torch 1.0.0" in line for line in lines)
        metrics = requests.get(f"{server.metrics_url}/metrics", timeout=30).text
        assert re.search(rf'HandlerCompiledModelRefusals\{{.*Reason="target".*ModelName="{name}"', metrics) \
            or re.search(rf'HandlerCompiledModelRefusals\{{.*ModelName="{name}".*Reason="target"', metrics)
    finally:
        requests.delete(f"{server.management_url}/models/{name}", timeout=60)
