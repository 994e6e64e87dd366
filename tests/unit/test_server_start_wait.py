"""The wait for a started TorchServe to be healthy, where its frontend is gone (no server runs
here: the addresses are free ports nobody listens on, the pid file names no process).
tests/server/test_startup.py starts a real one whose address is taken."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from torchserve_vision import paths
from torchserve_vision.server_process import ServerError, TorchServeInstance, instance_for, wait_until_healthy
from torchserve_vision.torchserve_config import server_config


def exited_frontend(tmp_path: Path, output: str) -> TorchServeInstance:
    """An instance whose pid file names no process (one past the kernel's highest pid), with
    `output` as what the frontend wrote."""
    instance = instance_for(server_config(tmp_path / "config", tmp_path / "store", paths.DEVELOPMENT_CONFIG,
                                          load_models=""), tmp_path / "run")
    instance.tmp_dir.mkdir(parents=True)
    never_a_process = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    (instance.tmp_dir / ".model_server.pid").write_text(str(never_a_process))
    (instance.run_dir / "torchserve.out").write_text(output)
    return instance


def test_a_frontend_that_exited_is_reported_at_once_with_its_last_lines(tmp_path):
    instance = exited_frontend(tmp_path, "starting\njava.lang.IllegalStateException: no\n")
    with pytest.raises(ServerError) as failed:
        wait_until_healthy(instance, timeout_s=600)
    message = str(failed.value)
    assert message.startswith(f"TorchServe at {instance.inference_url} exited while starting. Last lines of ")
    assert message.endswith("starting\njava.lang.IllegalStateException: no")


def test_an_address_it_could_not_bind_is_named(tmp_path):
    instance = exited_frontend(tmp_path, "java.io.IOException: Failed to bind to address: "
                                         "http://127.0.0.1:8081\nCaused by: io.netty.channel.unix.Errors"
                                         "$NativeIoException: bind(..) failed: Address already in use\n")
    with pytest.raises(ServerError, match=r"exited while starting: it could not bind "
                                          r"http://127\.0\.0\.1:8081 \(address already in use\)$"):
        wait_until_healthy(instance, timeout_s=600)


def test_a_frontend_gone_while_the_caller_stops_is_no_error(tmp_path):
    """A Ctrl-C reaches the frontend as well as `server run`, which has set its stop event."""
    instance = exited_frontend(tmp_path, "")
    stopping = threading.Event()
    stopping.set()
    wait_until_healthy(instance, timeout_s=600, cancelled=stopping)


def test_an_earlier_starts_output_is_not_taken_for_this_ones(tmp_path):
    """torchserve.out is appended to by every start of one run directory."""
    earlier = "java.io.IOException: Failed to bind to address: http://127.0.0.1:8081\n"
    instance = exited_frontend(tmp_path, earlier + "this start\n")
    with pytest.raises(ServerError) as failed:
        wait_until_healthy(instance, timeout_s=600, output_start=len(earlier))
    assert "could not bind" not in str(failed.value)
    assert str(failed.value).endswith("exited while starting. Last lines of "
                                      f"{instance.run_dir / 'torchserve.out'}:\nthis start")
