"""TorchServe started the plain way, as a user does without this project's command: TorchServe's
own `torchserve --start` with the model store and the shipped config, no frontend agent. The
queued model is served with TorchServe's own batching at the 1 ms delay the config gives it (not
the 100 ms TorchServe 0.12 reads for a delay of 0), and its workers say that the agent is missing:
a warning in the worker log at start, and in `models describe --handler`."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from tests.images import CAT_LABELS, photo_bytes
from tests.server.logs import log_lines
from torchserve_vision import paths
from torchserve_vision.model_descriptions import QUEUED_FALLBACK_DELAY_MS
from torchserve_vision.server_process import (
    TorchServeInstance,
    frontend_pid,
    instance_for,
    stop,
    torchserve_command,
    wait_until_healthy,
)
from torchserve_vision.torchserve_config import server_config
from torchserve_vision.worker_forkserver.frontend_setup import without_fork_server

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"


@pytest.fixture(scope="module")
def plain_server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServeInstance]:
    """config/config.properties on free ports, loading the classifier, started by `torchserve`
    itself (no effective config: no agent in vmargs, allowed_urls as shipped; no worker fork
    server: each worker is a process the frontend starts)."""
    run_dir = tmp_path_factory.mktemp("plain")
    config = server_config(run_dir, model_store, paths.DEVELOPMENT_CONFIG, load_models=f"{MODEL}-1.0.mar")
    instance = instance_for(config, run_dir)
    instance.tmp_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "torchserve.out").open("wb") as output:
        subprocess.run(torchserve_command(instance, ["--start", "--ncs", "--model-store", str(model_store),
                                                     "--ts-config", str(config)]),
                       cwd=run_dir, env=without_fork_server(instance.environment()), stdout=output,
                       stderr=subprocess.STDOUT, check=True)
    try:
        wait_until_healthy(instance, 240, expected_models=1)     # every worker READY
        yield instance
    finally:
        stop(instance)


def test_without_the_agent_the_model_is_served_with_the_configured_delay(plain_server):
    described = plain_server.client().describe(MODEL, "1.0")[0]
    assert "-javaagent" not in (plain_server.run_dir / "torchserve.out").read_text()
    assert described["maxBatchDelay"] == QUEUED_FALLBACK_DELAY_MS
    reply = requests.post(f"{plain_server.inference_url}/predictions/{MODEL}",
                          data=photo_bytes("chelsea.png"),
                          headers={"Content-Type": "application/octet-stream"}, timeout=60)
    assert reply.status_code == 200 and reply.json()[0]["label"] in CAT_LABELS


def test_each_worker_says_the_agent_is_missing_in_its_log_and_describe(plain_server):
    warnings = [line for line in log_lines(plain_server.log_dir / "model_log.log")
                if "runs without the frontend agent" in line]
    assert len(warnings) == 2          # one per worker, at start
    described = plain_server.client().describe(MODEL, "1.0", customized=True)[0]
    batching = described["customizedMetadata"]["batching"]
    assert batching["asked"] == "queued" and batching["frontend_agent"] is False
    assert described["customizedMetadata"]["frontend"]["pid"] == frontend_pid(plain_server)
    for worker in described["workers"]:        # each started by the frontend itself
        assert psutil.Process(int(worker["pid"])).parent().pid == frontend_pid(plain_server)
