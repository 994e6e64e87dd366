"""`torchserve-vision server run / status / stop` as a user (or a container) runs them: separate
processes, a real TorchServe, SIGTERM to the foreground process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.images import CAT_LABELS, PHOTOS_DIR
from torchserve_vision import paths
from torchserve_vision.server_process import frontend_pid, instance_for
from torchserve_vision.torchserve_config import server_config

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
