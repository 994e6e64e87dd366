"""TorchServe started the plain way, as a user does without this project's command: TorchServe's
own `torchserve --start` with the model store and the shipped config, no frontend agent. The
queued model is served with TorchServe's own batching at the 1 ms delay the config gives it (not
the 100 ms TorchServe 0.12 reads for a delay of 0), and its workers say that the agent is missing:
a warning in the worker log at start, and in `models describe`; a customized describe, which
TorchServe's own ContinuousBatching would answer forever, is refused."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from tests.images import CAT_LABELS, photo_bytes
from tests.server.http_client import assert_burst_answers_each_as_alone
from tests.server.logs import log_lines
from torchserve_vision import paths
from torchserve_vision.cli import main as command
from torchserve_vision.client import ManagementError
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
    """config/config.properties on free ports, loading both models, started by `torchserve`
    itself (no effective config: no agent in vmargs, allowed_urls as shipped; no worker fork
    server: each worker is a process the frontend starts)."""
    run_dir = tmp_path_factory.mktemp("plain")
    config = server_config(run_dir, model_store, paths.DEVELOPMENT_CONFIG)        # both models, as shipped
    instance = instance_for(config, run_dir)
    instance.tmp_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "torchserve.out").open("wb") as output:
        subprocess.run(torchserve_command(instance, ["--start", "--ncs", "--model-store", str(model_store),
                                                     "--ts-config", str(config)]),
                       cwd=run_dir, env=without_fork_server(instance.environment()), stdout=output,
                       stderr=subprocess.STDOUT, check=True)
    try:
        wait_until_healthy(instance, 240, expected_models=2)     # every worker READY
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


def test_each_worker_says_the_agent_is_missing_in_its_log_and_describe(plain_server, capsys):
    """The workers' warning at start; `models describe` reads from the frontend (the agent's
    series is not on its metrics endpoint) that TorchServe's own ContinuousBatching serves the
    version; a customized describe, which TorchServe 0.12 would answer forever in place of every
    later request of the version, is refused without reaching the workers, and the version goes
    on answering. (The worker's own account of its batching and of its frontend: tests/unit/
    test_serving.py; asking it here is what the refusal prevents.)"""
    warnings = [line for line in log_lines(plain_server.log_dir / "model_log.log")
                if "runs without the frontend agent" in line and f"-{MODEL}_" in line]
    assert len(warnings) == 2          # one per worker of the model, at start
    client = plain_server.client()
    assert client.batched_by_agent(MODEL, "1.0") is False
    capsys.readouterr()
    assert command(["models", "describe", MODEL, "--version", "1.0", "--management-url",
                    plain_server.management_url, "--metrics-url", plain_server.metrics_url]) == 0
    said = capsys.readouterr().out
    assert ("queued batching asked, but the frontend runs without the agent: TorchServe's "
            f"ContinuousBatching, max batch delay {QUEUED_FALLBACK_DELAY_MS} ms") in said
    with pytest.raises(ManagementError, match="without the frontend agent"):
        client.describe(MODEL, "1.0", customized=True)
    assert command(["models", "describe", MODEL, "--version", "1.0", "--handler", "--management-url",
                    plain_server.management_url, "--metrics-url", plain_server.metrics_url]) == 1
    assert "never takes another request" in capsys.readouterr().err
    described = client.describe(MODEL, "1.0")[0]
    assert described["jobQueueStatus"]["pendingRequests"] == 0     # no describe job left queued
    reply = requests.post(f"{plain_server.inference_url}/predictions/{MODEL}",
                          data=photo_bytes("chelsea.png"),
                          headers={"Content-Type": "application/octet-stream"}, timeout=60)
    assert reply.status_code == 200 and reply.json()[0]["label"] in CAT_LABELS
    for worker in described["workers"]:        # each started by the frontend itself
        assert psutil.Process(int(worker["pid"])).parent().pid == frontend_pid(plain_server)


def test_bursts_of_48_photos_and_bad_payloads_to_the_detector_each_get_their_own_answer(plain_server):
    """Without the agent, TorchServe's own queue (job_queue_size, 100: the archives carry none of
    their own) holds every burst: no request refused with TorchServe's "has no worker" 503."""
    assert_burst_answers_each_as_alone(f"{plain_server.inference_url}/predictions/ssd_mobilenet_v2")


def test_server_commands_leave_a_torchserve_they_did_not_start_and_say_so(plain_server, tmp_path, capsys):
    """TorchServe started by hand answers at the config's address: `server stop` (another run
    directory) stops nothing and says what still answers; `server start` starts nothing."""
    location = ["--config", str(plain_server.config_path), "--run-dir", str(tmp_path / "elsewhere")]
    assert command(["server", "stop", *location]) == 1
    said = capsys.readouterr()
    assert "no TorchServe was running from" in said.out
    assert f"still answers at {plain_server.inference_url}" in said.err and "torchserve --stop" in said.err
    assert command(["server", "start", *location]) == 1
    assert "a TorchServe not started from" in capsys.readouterr().err
    assert frontend_pid(plain_server) is not None
