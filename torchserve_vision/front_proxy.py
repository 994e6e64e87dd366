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

import hashlib
import os
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


# The canary split (torchserve_vision.canary): two maps, model -> canary version and model -> the
# percent of its unversioned requests that version answers, in the server's traffic directory,
# changed through HAProxy's runtime API on its admin socket there (no reload, no dropped
# connection) and on disk (a restarted front keeps the split).
CANARY_VERSION_MAP, CANARY_PERCENT_MAP = "canary_version.map", "canary_percent.map"
ADMIN_SOCKET = "front.sock"
# One datagram per answered request, `<model or -> <canary version or -> <status> <ms>`, to this
# socket when a `models canary --auto` walk listens there (HAProxy drops the lines when nobody
# does).
REQUEST_LOG_SOCKET = "front-requests.sock"
# The header whose hash places a client on one side of the split for good (sticky assignment).
CANARY_KEY_HEADER = "X-Canary-Key"
# The longest socket path HAProxy takes for `log unix@...` (2.6: "too long (max 97)"); a stats
# socket may be a little longer (sun_path), the same bound keeps both simple.
SOCKET_PATH_MAX = 97


def traffic_socket(traffic_dir: Path, name: str) -> Path:
    """Where the front's socket `name` lives: in `traffic_dir`, or, where that path is too long
    for HAProxy (a deep run directory), in a directory of this user's under the temporary
    directory named by a hash of `traffic_dir`, so the commands that talk to the front find the
    same path from the traffic directory alone."""
    path = traffic_dir / name
    if len(str(path)) <= SOCKET_PATH_MAX:
        return path
    owned = Path(tempfile.gettempdir()) / f"torchserve-vision-{os.getuid()}"
    owned.mkdir(mode=0o700, exist_ok=True)
    state = owned.lstat()
    if owned.is_symlink() or state.st_uid != os.getuid() or state.st_mode & 0o077:
        raise FrontError(f"{owned} must be a directory of this user's that nobody else can "
                         "write: it holds the front's sockets")
    short = owned / hashlib.sha256(str(traffic_dir.resolve()).encode()).hexdigest()[:16]
    short.mkdir(mode=0o700, exist_ok=True)
    path = short / name
    if len(str(path)) > SOCKET_PATH_MAX:
        raise FrontError(f"the front's socket path {path} is over HAProxy's {SOCKET_PATH_MAX} "
                         "characters: set TMPDIR to a shorter directory")
    return path


def canary_rules(traffic_dir: Path) -> str:
    """Requests for a model's default version (`/predictions/{m}`, `/v2/models/{m}/infer`) whose
    draw (random, or the hash of X-Canary-Key) falls under the model's canary percent go to
    `/predictions/{m}/{canary version}` (where the handler reads the same body, v2 included)."""
    versions, percents = traffic_dir / CANARY_VERSION_MAP, traffic_dir / CANARY_PERCENT_MAP
    key = f"req.hdr({CANARY_KEY_HEADER})"
    return "".join(f"    {line}\n" for line in [
        "acl unversioned_prediction path_reg ^/predictions/[^/]+/?$",
        "acl unversioned_v2_infer path_reg ^/v2/models/[^/]+/infer$",
        "http-request set-var(txn.model) path,field(3,/) if unversioned_prediction",
        "http-request set-var(txn.model) path,field(4,/) if unversioned_v2_infer",
        "acl model_found var(txn.model) -m found",
        f"http-request set-var(txn.canary_percent) var(txn.model),map_str_int({percents},0) "
        "if model_found",
        "acl canary_on var(txn.canary_percent) -m int gt 0",
        f"acl canary_key_sent {key} -m found",
        "http-request set-var(txn.draw) rand(100) if canary_on",
        f"http-request set-var(txn.draw) {key},xxh32,mod(100) if canary_on canary_key_sent",
        "acl drawn_for_canary var(txn.draw),sub(txn.canary_percent) -m int lt 0",
        f"http-request set-var(txn.canary_version) var(txn.model),map({versions}) "
        "if canary_on drawn_for_canary",
        "http-request set-path /predictions/%[var(txn.model)]/%[var(txn.canary_version)] "
        "if { var(txn.canary_version) -m found }",
        "log global",
        'log-format "%[var(txn.model)] %[var(txn.canary_version)] %ST %Ta"',
    ])


def prepare_traffic_dir(traffic_dir: Path) -> None:
    """The canary maps must exist when HAProxy starts (empty: no split)."""
    traffic_dir.mkdir(parents=True, exist_ok=True)
    for name in (CANARY_VERSION_MAP, CANARY_PERCENT_MAP):
        (traffic_dir / name).touch()


def front_config(bind_host: str, port: int, inference_url: str, model_endpoints_port: int,
                 timeout_s: int, traffic_dir: Path | None = None) -> str:
    """HAProxy's configuration: `bind_host:port` in front of `inference_url`; model endpoints to
    127.0.0.1:`model_endpoints_port`. `timeout_s` bounds a request (TorchServe's response
    timeout is the one that should fire first). With `traffic_dir`, the canary split
    (`canary_rules`) and the admin socket that changes it."""
    admin = (f"    stats socket {traffic_socket(traffic_dir, ADMIN_SOCKET)} mode 600 level admin\n"
             f"    log unix@{traffic_socket(traffic_dir, REQUEST_LOG_SOCKET)} len 1024 format raw local0\n"
             if traffic_dir is not None else "")
    canary = canary_rules(traffic_dir) if traffic_dir is not None else ""
    return f"""global
    maxconn 4096
{admin}defaults
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
{canary}    use_backend model_endpoints if METH_GET model_endpoint
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
