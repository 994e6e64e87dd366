"""`torchserve-vision server run / start / status / stop` as a user (or a container) runs them:
separate processes, a real TorchServe, SIGTERM to the foreground process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import requests

from tests.images import CAT_LABELS, PHOTOS_DIR
from torchserve_vision import paths
from torchserve_vision.front_proxy import accepts_connections
from torchserve_vision.server_process import frontend_pid, instance_for
from torchserve_vision.torchserve_config import free_ports, server_config

pytestmark = pytest.mark.server


def command(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "torchserve_vision", *arguments]


def test_run_serves_until_sigterm_then_stops_and_exits_zero(model_store: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    config = server_config(tmp_path, model_store, paths.DEVELOPMENT_CONFIG,
                           load_models="efficientnet_lite0-1.0.mar")
    location = ["--config", str(config), "--run-dir", str(run_dir)]
    process = subprocess.Popen(command("server", "run", *location), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        ready_line = process.stdout.readline()   # printed once every model's workers are READY
        assert "is ready at" in ready_line, (ready_line, process.stderr and process.stderr.read())
        instance = instance_for(config, run_dir)
        status = subprocess.run(command("server", "status", *location), capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0 and "every model has READY workers" in status.stdout
        answer = subprocess.run(command("predict", str(PHOTOS_DIR / "chelsea.png"), "--json",
                                        "--inference-url", instance.inference_url),
                                capture_output=True, text=True, timeout=60)
        assert answer.returncode == 0, answer.stderr
        assert any(label in answer.stdout for label in CAT_LABELS)
        pid = frontend_pid(instance)
        assert pid is not None
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            subprocess.run(command("server", "stop", *location), timeout=120, check=False)
    assert process.returncode == 0, err
    assert "TorchServe has stopped" in out
    assert frontend_pid(instance) is None
    stopped = subprocess.run(command("server", "status", *location), capture_output=True, text=True,
                             timeout=60)
    assert stopped.returncode == 1 and "not answering /ping" in stopped.stdout


def test_start_with_a_front_returns_ready_and_stop_leaves_nothing_running(model_store: Path,
                                                                          tmp_path: Path):
    """`server start --front-port F` runs `server run` with its front in the background: the
    command returns once it is ready, the front answers, and `server stop` ends all of it."""
    run_dir = tmp_path / "run"
    config = server_config(tmp_path, model_store, paths.DEVELOPMENT_CONFIG,
                           load_models="efficientnet_lite0-1.0.mar")
    location = ["--config", str(config), "--run-dir", str(run_dir)]
    front_port = free_ports(1)[0]
    try:
        started = subprocess.run(command("server", "start", *location, "--front-port", str(front_port)),
                                 capture_output=True, text=True, timeout=300)
        assert started.returncode == 0, started.stderr
        assert f"the front on port {front_port}" in started.stdout
        answer = requests.post(f"http://127.0.0.1:{front_port}/predictions/efficientnet_lite0",
                               data=(PHOTOS_DIR / "chelsea.png").read_bytes(), timeout=60)
        assert answer.status_code == 200 and answer.headers["X-Model-Version"] == "1.0"
        status = subprocess.run(command("server", "status", *location), capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0
        assert_a_running_server_is_left_as_it_is(location, front_port)
        answer = requests.post(f"http://127.0.0.1:{front_port}/predictions/efficientnet_lite0",
                               data=(PHOTOS_DIR / "chelsea.png").read_bytes(), timeout=60)
        assert answer.status_code == 200
    finally:
        stopped = subprocess.run(command("server", "stop", *location), capture_output=True,
                                 text=True, timeout=300)
    assert stopped.returncode == 0, stopped.stderr
    assert f"TorchServe has stopped (run directory {run_dir})" in stopped.stdout
    assert frontend_pid(instance_for(config, run_dir)) is None
    assert not accepts_connections(front_port)
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"])
            if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert left == []


def assert_a_running_server_is_left_as_it_is(location: list[str], front_port: int) -> None:
    """`server run` (the README's gRPC example's command) where the run directory's server runs
    already: refused, saying so, the server untouched; `server start` says it serves, with its
    front, and refuses a front it does not have."""
    pid = frontend_pid(instance_for(Path(location[1]), Path(location[3])))
    probe_port, other_port = free_ports(2)
    refused = subprocess.run(command("server", "run", *location, "--probe-port", str(probe_port)),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "TorchServe is already running from" in refused.stderr, refused
    assert "it was left running" in refused.stderr and "Traceback" not in refused.stderr
    again = subprocess.run(command("server", "start", *location, "--front-port", str(front_port)),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and f"its front on port {front_port}" in again.stdout, again
    other = subprocess.run(command("server", "start", *location, "--front-port", str(other_port)),
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 1 and f"without a front on port {other_port}" in other.stderr, other
    assert frontend_pid(instance_for(Path(location[1]), Path(location[3]))) == pid
