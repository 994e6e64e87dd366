"""Telling an instance's TorchServe workers (or their stand-ins) by their command lines."""

from __future__ import annotations

from pathlib import Path

from torchserve_vision.worker_processes import is_worker_of

TMP = Path("/srv/run/tmp")
SCRIPT = "/venv/lib/python3.12/site-packages/ts/model_service_worker.py"


def worker_line(socket: str) -> list[str]:
    return ["/venv/bin/python", SCRIPT, "--sock-type", "unix", "--sock-name", socket,
            "--metrics-config", "/venv/lib/python3.12/site-packages/ts/configs/metrics.yaml"]


def test_a_worker_whose_socket_lies_in_the_instances_tmpdir_is_its_own():
    assert is_worker_of(worker_line("/srv/run/tmp/.ts.sock.9000"), TMP)


def test_another_instances_worker_is_not():
    assert not is_worker_of(worker_line("/srv/other/tmp/.ts.sock.9000"), TMP)
    assert not is_worker_of(worker_line("/srv/run/tmp/nested/.ts.sock.9000"), TMP)


def test_a_process_that_only_names_the_directory_is_not_a_worker():
    assert not is_worker_of(["tail", "-f", "/srv/run/tmp/.ts.sock.9000"], TMP)
    assert not is_worker_of(["/venv/bin/python", "-m", "torchserve_vision.worker_forkserver.server",
                             "--directory", "/srv/run/tmp"], TMP)
    assert not is_worker_of([], TMP)


def test_a_worker_without_a_socket_in_the_directory_is_not_its_own():
    line = worker_line("/srv/run/tmp/.ts.sock.9000")
    line[line.index("--sock-name") + 1] = "/srv/run/tmp/other.sock"
    assert not is_worker_of(line, TMP)
