"""The front of a served instance: HAProxy on one address, in front of TorchServe's inference
address, so that a client of the Open Inference Protocol finds every endpoint it calls in one
place. `GET /v2/models/{m}[/versions/{v}][/ready]`, which TorchServe 0.12 does not route, goes to
the model endpoints of `server run`'s probe server (torchserve_vision.v2_model_endpoints);
everything else (inference, `/v2/health/*`, `/v2`, `/ping`, `/predictions`, KServe v1) goes to
TorchServe unchanged, headers included. HAProxy (Debian's package; scripts/setup.sh installs it)
was chosen because it adds a fraction of a millisecond and can also split traffic by weight
(docs/benchmarks.md, "The front proxy").
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from torchserve_vision.errors import CommandError
from torchserve_vision.waiting import wait_until

MODEL_ENDPOINT_PATTERN = r"^/v2/models/[^/]+(/versions/[^/]+)?(/ready)?$"
# TorchServe 0.12 answers POST /v2/models/{m}/versions/{v}/infer with 501 ("Model versioning is
# not yet supported", OpenInferenceProtocolRequestHandler); the front sends it to the route that
# serves versions, /predictions/{m}/{v}, where the handler reads the same v2 body.
VERSIONED_INFER = r"^/v2/models/[^/]+/versions/[^/]+/infer$"
TO_PREDICTIONS = (r"""http-request set-path "%[path,regsub('^/v2/models/([^/]+)/versions/([^/]+)/infer\$',"""
                  r"""'/predictions/\\1/\\2')]" if versioned_infer""")


class FrontError(CommandError, RuntimeError):
    """HAProxy is missing, or did not start."""


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise FrontError("haproxy is not installed (scripts/setup.sh installs it with apt as root)")
    return found


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def front_config(bind_host: str, port: int, inference_url: str, model_endpoints_port: int,
                 timeout_s: int) -> str:
    """HAProxy's configuration: `bind_host:port` in front of `inference_url`; model endpoints to
    127.0.0.1:`model_endpoints_port`. `timeout_s` bounds a request (TorchServe's response
    timeout is the one that should fire first)."""
    return f"""global
    maxconn 4096
defaults
    mode http
    option http-keep-alive
    timeout connect 5s
    timeout client {timeout_s}s
    timeout server {timeout_s}s
    timeout http-keep-alive 60s
frontend inference
    bind {bind_host}:{port}
    acl model_endpoint path_reg {MODEL_ENDPOINT_PATTERN}
    acl versioned_infer path_reg {VERSIONED_INFER}
    {TO_PREDICTIONS}
    use_backend model_endpoints if METH_GET model_endpoint
    default_backend torchserve
backend torchserve
    server torchserve 127.0.0.1:{urlparse(inference_url).port}
backend model_endpoints
    server endpoints 127.0.0.1:{model_endpoints_port}
"""


@dataclass
class FrontProxy:
    """HAProxy with `config` as a child process for the length of the block."""

    config: str
    port: int
    start_timeout_s: float = 10.0
    _process: subprocess.Popen[bytes] | None = None
    _directory: tempfile.TemporaryDirectory[str] = field(default_factory=tempfile.TemporaryDirectory)

    def __enter__(self) -> FrontProxy:
        path = Path(self._directory.name) / "haproxy.cfg"
        path.write_text(self.config)
        self._process = subprocess.Popen([haproxy_binary(), "-db", "-f", str(path)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def listening() -> bool:
            if self._process is not None and self._process.poll() is not None:
                error = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
                raise FrontError(f"haproxy exited with {self._process.returncode}: {error[-1000:]}")
            return accepts_connections(self.port)

        wait_until(listening, self.start_timeout_s, f"haproxy on port {self.port}", interval_s=0.1,
                   error=FrontError)
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def __exit__(self, *exc: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        self._directory.cleanup()
