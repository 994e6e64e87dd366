"""`server run` as a container runs it: PID 1 (`unshare --pid --mount-proc`: a PID namespace of
its own) with its logs on standard output, as JSON lines (`--log-to json`; the image's command
writes the same logs as text, `--log-to stdout`, from the same loggers).
TorchServe's `torchserve --start` exits and leaves the Java frontend to PID 1, so what dies in
there is PID 1's to reap, and a dead frontend must end the pod (the kubelet then restarts the
container) instead of leaving `/live` answering 200 beside a zombie. A killed worker is
TorchServe's to replace: the pod stays live and becomes ready again. The logs are where
`kubectl logs` reads them, and not in files that die with the pod."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from tests.images import photo_bytes
from tests.server.logs import rejected_requests
from torchserve_vision import paths
from torchserve_vision.lab.pods import Pod
from torchserve_vision.torchserve_config import server_config
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
FRONTEND_CLASS = "org.pytorch.serve.ModelServer"
WORKER_SCRIPT = "model_service_worker.py"


@pytest.fixture(scope="module")
def pid_one_pod(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    """One pod for the module (each start costs half a minute): the tests run in file order, and
    the last one ends the pod."""
    tmp_path = tmp_path_factory.mktemp("pid_one")
    config = server_config(tmp_path, model_store, paths.DEVELOPMENT_CONFIG,
                           load_models="efficientnet_lite0-1.0.mar")
    pod = Pod("pid1", config, tmp_path / "run", model_store, drain_delay_s=0.0,
              environment={"TSV_WORKERS": "1"}, pid_namespace=True, log_to="json")
    with pod.running():
        yield pod


def namespace(pod: Pod) -> list[psutil.Process]:
    """Every process of the pod's PID namespace (the children of `unshare`, recursively)."""
    assert pod.process is not None
    return psutil.Process(pod.process.pid).children(recursive=True)


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:                             # gone, or a zombie
        return ""


def one_of(processes: list[psutil.Process], marker: str) -> psutil.Process:
    found = [process for process in processes if marker in command_line(process)]
    assert len(found) == 1, [command_line(process) for process in processes]
    return found[0]


def zombies(pod: Pod) -> list[int]:
    found = []
    for process in namespace(pod):
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def logged_objects(pod: Pod) -> list[dict[str, Any]]:
    """The pod's standard output, one JSON object per line (a line that is not one fails)."""
    objects = [json.loads(line) for line in pod.output().splitlines() if line.strip()]
    assert all(isinstance(item, dict) and {"time", "log", "message"} <= item.keys() for item in objects)
    return objects


def test_the_logs_are_json_lines_on_standard_output_and_not_in_files(pid_one_pod: Pod):
    url = f"{pid_one_pod.instance.inference_url}/predictions/efficientnet_lite0"
    assert requests.post(url, data=photo_bytes("chelsea.png"), timeout=30).status_code == 200
    assert requests.post(url, data=b"not an image", timeout=30).status_code == 400

    def logged(log: str, *texts: str) -> bool:
        return any(item["log"] == log and all(text in item["message"] for text in texts)
                   for item in logged_objects(pid_one_pod))

    wait_until(lambda: logged("access", '"POST /predictions/efficientnet_lite0 HTTP/1.1" 400'), 30,
               "the refused request's access line")
    assert logged("access", '"POST /predictions/efficientnet_lite0 HTTP/1.1" 200')
    assert logged("model", "worker ready model=efficientnet_lite0")   # the worker's line
    assert logged("ts", "Management API bind to")                     # the frontend's
    assert logged("server", "TorchServe is ready")                    # server run's own
    assert logged("console", "Model server started")                  # TorchServe's launcher's
    assert not logged("access", '"GET /ping HTTP/1.1"')     # the readiness poller's reads: left out
    wait_until(lambda: rejected_requests([item["message"] for item in logged_objects(pid_one_pod)
                                          if item["log"] == "model"]) >= 1, 30,
               "the worker's batch line with the refused request")
    levels = {item.get("level") for item in logged_objects(pid_one_pod) if item["log"] in ("ts", "model")}
    assert "INFO" in levels
    assert not list((pid_one_pod.run_dir / "logs").glob("*.log"))


def test_a_killed_worker_is_replaced_and_the_pod_stays_live(pid_one_pod: Pod):
    worker = one_of(namespace(pid_one_pod), WORKER_SCRIPT)
    os.kill(worker.pid, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(worker.pid), 30, "the worker reaped")
    assert pid_one_pod.probe("/live")[0] == 200
    wait_until(lambda: any(WORKER_SCRIPT in command_line(process) for process in namespace(pid_one_pod)),
               60, "a new worker")
    pid_one_pod.wait_ready(timeout_s=120)
    assert pid_one_pod.probe("/live")[0] == 200
    replacement = one_of(namespace(pid_one_pod), WORKER_SCRIPT)
    assert replacement.pid != worker.pid
    wait_until(lambda: not zombies(pid_one_pod), 30, "no zombie in the pod")


def test_a_dead_frontend_ends_the_pod_and_leaves_nothing_behind(pid_one_pod: Pod):
    processes = namespace(pid_one_pod)
    frontend = one_of(processes, FRONTEND_CLASS)
    os.kill(frontend.pid, signal.SIGKILL)
    assert pid_one_pod.process is not None
    code = pid_one_pod.process.wait(timeout=60)     # `server run` noticed and exited: PID 1 gone
    assert code != 0, pid_one_pod.output()[-2000:]
    assert "TorchServe exited on its own" in pid_one_pod.output()
    assert pid_one_pod.probe("/live")[0] == 0       # nobody answers the kubelet's probe
    assert not any(psutil.pid_exists(process.pid) for process in processes)

