"""Readiness and liveness of a `server run` process, on a port of its own, for a kubelet or a
load balancer: no credentials needed, nothing revealed beyond ready / not ready and why.

- `GET /ready`: 200 only when the process is not draining and every model's default version has
  its minimum of READY workers (`server_state.not_ready_reason`, asked through the management API
  with the instance's key file, so it works with token authorization on: keys are read and
  refreshed locally and never leave the pod). A background thread asks once per `poll_s`; the
  probe answers from that result, so a probe never waits on TorchServe, and a result older than
  `stale_s` counts as not ready. /ping is not used: it answers Healthy while workers crash-loop.
- `GET /live`: 200 while this process runs and the TorchServe frontend it started is alive (or
  still starting). It asks TorchServe nothing, so a pod busy with a long queue is never restarted
  for being slow; a dead frontend ends `server run` anyway, and the container restarts.
- With model endpoints (`server run --front-port`): `GET /v2/models/{m}[/versions/{v}][/ready]`
  of the Open Inference Protocol (torchserve_vision.v2_model_endpoints), which the front proxy
  routes here from the inference address; those ask for TorchServe's inference key when token
  authorization is on.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from torchserve_vision.v2_model_endpoints import V2ModelEndpoints, is_model_endpoint

NOT_STARTED = "TorchServe is starting"


@dataclass
class PodHealth:
    """What the probes answer; `check()` says why TorchServe is not ready (None: ready)."""

    check: Callable[[], str | None]
    frontend_alive: Callable[[], bool]
    poll_s: float = 1.0
    stale_s: float = 5.0
    started: threading.Event = field(default_factory=threading.Event)
    draining: threading.Event = field(default_factory=threading.Event)
    _reason: str | None = NOT_STARTED
    _checked_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh(self) -> None:
        reason = self.check() if self.started.is_set() else NOT_STARTED
        with self._lock:
            self._reason, self._checked_at = reason, time.monotonic()

    def not_ready_reason(self) -> str | None:
        if self.draining.is_set():
            return "draining"
        with self._lock:
            reason, age = self._reason, time.monotonic() - self._checked_at
        if reason is None and age > self.stale_s:
            return f"readiness not checked for {age:.0f} s"
        return reason

    def alive(self) -> bool:
        return not self.started.is_set() or self.frontend_alive()


class ProbeHandler(BaseHTTPRequestHandler):
    server: ProbeServer

    def do_GET(self) -> None:
        health, endpoints = self.server.health, self.server.model_endpoints
        if endpoints is not None and is_model_endpoint(self.path):
            self.answer(*endpoints.answer(self.path, dict(self.headers.items())))
        elif self.path == "/ready":
            reason = health.not_ready_reason()
            self.answer(200 if reason is None else 503,
                        {"ready": reason is None, **({"reason": reason} if reason else {})})
        elif self.path == "/live":
            alive = health.alive()
            self.answer(200 if alive else 503, {"live": alive})
        else:
            self.answer(404, {"error": "use /ready or /live"})

    def answer(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: quiet
        pass


class ProbeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], health: PodHealth,
                 model_endpoints: V2ModelEndpoints | None = None) -> None:
        self.health, self.model_endpoints = health, model_endpoints
        super().__init__(address, ProbeHandler)


@dataclass
class ProbeEndpoint:
    """The probe server and the readiness poller, as threads of this process."""

    health: PodHealth
    host: str
    port: int
    model_endpoints: V2ModelEndpoints | None = None
    _server: ProbeServer | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> ProbeEndpoint:
        self._server = ProbeServer((self.host, self.port), self.health, self.model_endpoints)
        self.port = self._server.server_address[1]
        # polled every 50 ms, not socketserver's 0.5 s: a stop's `shutdown` waits for the next poll
        self._threads = [threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                          daemon=True),
                         threading.Thread(target=self._poll, daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.health.refresh()
            self._stop.wait(self.health.poll_s)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=10)
