"""A `torchserve-vision server run` process as a container runs it: its own run directory,
environment, probe port, SIGTERM to stop. The pod lifecycle tests and the rolling-update
rehearsal start these."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests

from torchserve_vision.deployment_settings import DeploymentSettings
from torchserve_vision.errors import CommandError
from torchserve_vision.server_process import TorchServeInstance, instance_for, stop
from torchserve_vision.torchserve_config import free_ports
from torchserve_vision.waiting import wait_until
from torchserve_vision.worker_forkserver import OWNER_VARIABLE


class PodError(CommandError, RuntimeError):
    """The process did not become ready, or exited when it should not have."""


@dataclass
class Pod:
    name: str
    config: Path
    run_dir: Path
    model_store: Path
    drain_delay_s: float = 2.0
    drain_timeout_s: float = 30.0
    environment: dict[str, str] = field(default_factory=dict)
    probe_port: int = field(default_factory=lambda: free_ports(1)[0])
    front_port: int | None = None      # `--front-port`: none unless given
    grpc_front_port: int | None = None  # `--grpc-front-port` (needs front_port): none unless given
    # As a container runs it: PID 1 of a PID namespace of its own (unshare; root only), which
    # adopts what TorchServe leaves behind and dies with its namespace.
    pid_namespace: bool = False
    log_to: str = "files"              # `--log-to`: files (run_dir/logs), stdout or json (output_path)
    process: subprocess.Popen[bytes] | None = None
    signalled_at: float | None = None

    @property
    def instance(self) -> TorchServeInstance:
        settings = DeploymentSettings.from_environment({**os.environ, **self.environment})
        return instance_for(self.config, self.run_dir, settings=settings)

    @property
    def probe_url(self) -> str:
        return f"http://127.0.0.1:{self.probe_port}"

    @property
    def output_path(self) -> Path:
        return self.run_dir / "server-run.out"

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.is_file() else ""

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "torchserve_vision", "server", "run",
                   "--config", str(self.config), "--run-dir", str(self.run_dir),
                   "--model-store", str(self.model_store), "--probe-port", str(self.probe_port),
                   "--drain-delay", str(self.drain_delay_s), "--drain-timeout", str(self.drain_timeout_s)]
        if self.front_port is not None:
            command += ["--front-port", str(self.front_port)]
        if self.grpc_front_port is not None:
            command += ["--grpc-front-port", str(self.grpc_front_port)]
        command += ["--log-to", self.log_to]
        environment = {**os.environ, **self.environment}
        if self.pid_namespace:
            command = ["unshare", "--pid", "--mount-proc", "--kill-child", *command]
            # no pid outside the namespace means anything inside it: its own fork server, as a
            # container's
            environment.pop(OWNER_VARIABLE, None)
        with open(self.output_path, "ab") as output:
            # a session of its own, so that `kill` reaches what it started (the front's HAProxy)
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                            env=environment, start_new_session=True)
        self.signalled_at = None

    def probe(self, path: str = "/ready") -> tuple[int, dict[str, object]]:
        """The probe's status and body; (0, {}) when it does not answer."""
        try:
            answer = requests.get(self.probe_url + path, timeout=2)
            return answer.status_code, answer.json()
        except (requests.RequestException, ValueError):
            return 0, {}

    def ready(self) -> bool:
        return self.probe("/ready")[0] == 200

    def wait_ready(self, timeout_s: float = 240.0) -> float:
        """Seconds until /ready answers 200; PodError if the process exits or time runs out."""
        def ready_or_exited() -> bool:
            if self.process is None or self.process.poll() is not None:
                raise PodError(f"{self.name} exited before it was ready:\n{self.output()[-3000:]}")
            return self.ready()

        return wait_until(ready_or_exited, timeout_s, f"{self.name} to be ready",
                          error=lambda message: PodError(f"{message}:\n{self.output()[-3000:]}"))

    def terminate(self) -> None:
        """SIGTERM, as the kubelet sends it."""
        assert self.process is not None
        self.signalled_at = time.monotonic()
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> tuple[int, float]:
        """The exit status and the seconds from SIGTERM to exit."""
        assert self.process is not None and self.signalled_at is not None
        code = self.process.wait(timeout=timeout_s)
        return code, time.monotonic() - self.signalled_at

    @contextmanager
    def running(self) -> Iterator[Pod]:
        """Started and ready for the length of the block; killed (with its TorchServe) after."""
        try:
            self.start()
            self.wait_ready()
            yield self
        finally:
            self.kill()

    def kill(self) -> None:
        """Cleanup after a failed test or rehearsal: the process, everything else of its session
        (the front's HAProxy would otherwise outlive it), and its TorchServe."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):   # already gone, with its session
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        if not self.pid_namespace:
            # A namespace's processes die with its PID 1, and the pid file there names a pid of
            # that namespace: read here it is another process (stop waited 60 s for it to exit).
            stop(self.instance)
