"""Load generator for /predictions/{model}[/{version}] with real image bodies.

    # closed loop: 16 clients sending back to back for 20 s
    torchserve-vision lab load --model efficientnet_lite0 --clients 16 --duration 20
    # open loop: Poisson arrivals at 50 requests/s for 30 s (queueing shows as in production)
    torchserve-vision lab load --model efficientnet_lite0 --rate 50 --duration 30 --json
    # the client's own ceiling, against a built-in server that answers at once
    torchserve-vision lab load --self-test --clients 8 --duration 5

Every client thread keeps one HTTP/1.1 keep-alive connection (http.client, no per-request
set-up: the generator is a measuring instrument, and every microsecond of client CPU would count
as server latency); the URL and the inference key come from the project's client. Open-loop
latency is measured from each request's scheduled arrival time, so time spent waiting for a free
client counts (no coordinated omission). Runs are bounded by --duration and --max-requests.
"""

from __future__ import annotations

import base64
import json
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from torchserve_vision.http_connection import KeepAliveConnection

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Result:
    scheduled_s: float   # when it should have been sent (open loop) or was sent (closed loop)
    latency_ms: float    # from scheduled_s to the end of the answer
    status: int          # HTTP status; 0 = connection error or timeout
    wait_ms: float = 0.0  # open loop: from the scheduled time until a client was free to send
    version: str = ""     # the answer's X-Model-Version ("" when it had none)


@dataclass
class Report:
    mode: str
    duration_s: float
    sent: int
    succeeded: int
    errors: dict[str, int]
    throughput_rps: float
    latency_ms: dict[str, float]
    offered_rps: float | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def table(self) -> str:
        latency = "  ".join(f"{k} {v:.1f}" for k, v in self.latency_ms.items())
        offered = f" offered {self.offered_rps:.1f}/s," if self.offered_rps else ""
        return (f"{self.mode}: {self.sent} sent,{offered} {self.succeeded} ok "
                f"({self.throughput_rps:.1f}/s over {self.duration_s:.1f} s), "
                f"errors {self.errors or 'none'}\n  latency ms (ok): {latency}")


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float]:
    """p50/p90/p95/p99/max (linear interpolation between ranks); zeros when empty."""
    if not latencies_ms:
        return {**{f"p{p}": 0.0 for p in PERCENTILES}, "max": 0.0}
    values = np.asarray(latencies_ms, dtype=float)
    summary = {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}
    summary["max"] = float(values.max())
    return summary


def poisson_schedule(rate_rps: float, duration_s: float, seed: int = 0) -> list[float]:
    """Arrival offsets in [0, duration_s): exponential gaps with mean 1 / rate_rps."""
    if rate_rps <= 0:
        raise ValueError("rate must be > 0")
    rng = np.random.default_rng(seed)
    expected = int(rate_rps * duration_s * 1.5) + 16
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, size=expected))
    while arrivals[-1] < duration_s:  # rare: draw more
        more = arrivals[-1] + np.cumsum(rng.exponential(1.0 / rate_rps, size=expected))
        arrivals = np.concatenate([arrivals, more])
    return arrivals[arrivals < duration_s].tolist()


def error_counts(results: Iterable[Result]) -> dict[str, int]:
    """The failed results by status (`connection` for a connection error or timeout), sorted."""
    errors = Counter("connection" if r.status == 0 else str(r.status) for r in results if r.status != 200)
    return dict(sorted(errors.items()))


def summarize(mode: str, results: Sequence[Result], duration_s: float,
              offered_rps: float | None = None) -> Report:
    ok = [r.latency_ms for r in results if r.status == 200]
    errors = error_counts(results)
    return Report(mode=mode, duration_s=duration_s, sent=len(results), succeeded=len(ok),
                  errors=errors, throughput_rps=len(ok) / max(duration_s, 1e-9),
                  latency_ms=latency_summary(ok), offered_rps=offered_rps)


@dataclass
class LoadTarget:
    url: str
    bodies: Sequence[bytes]
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/octet-stream"})
    timeout_s: float = 60.0
    # When set (closed loop), the last successful answer's body per index of `bodies`.
    answers: dict[int, bytes] | None = None

    def connection(self) -> KeepAliveConnection:
        return KeepAliveConnection(self.url, self.timeout_s, self.headers)


Progress = Callable[[int], None]


def instances_bodies(images: Sequence[bytes], per_request: int) -> list[bytes]:
    """KServe v1 bodies of `per_request` images each (`{"instances": [{"data": <base64>}, ...]}`),
    taking `images` in turn; as many bodies as images, so every image leads one body."""
    encoded = [base64.b64encode(image).decode() for image in images]
    return [json.dumps({"instances": [{"data": encoded[(start + i) % len(encoded)]}
                                      for i in range(per_request)]}).encode()
            for start in range(len(encoded))]


# What a closed-loop client does after a 503: send again at once (a client with no back-off), or
# wait the Retry-After the answer gives first (one that honours it).
REFUSAL_MODES = ("resend", "retry-after")


def run_closed_loop(target: LoadTarget, clients: int, duration_s: float, max_requests: int,
                    progress: Progress | None = None, on_refusal: str = "resend") -> Report:
    """`clients` threads, each sending its next request as soon as the last one is answered; after
    a 503, at once (`on_refusal="resend"`) or once its Retry-After has passed ("retry-after").
    The report's extra counts the refusals (`refused_per_s`)."""
    results: list[Result] = []
    lock = threading.Lock()
    started = time.perf_counter()
    deadline = started + duration_s

    def client(index: int) -> None:
        connection = target.connection()
        count = 0
        while time.perf_counter() < deadline:
            with lock:
                if len(results) >= max_requests:
                    break
            sent = time.perf_counter()
            body_index = (index + count * clients) % len(target.bodies)
            status = connection.post(target.bodies[body_index])
            count += 1
            with lock:
                results.append(Result(sent - started, (time.perf_counter() - sent) * 1000, status,
                                      version=connection.last_version))
                if target.answers is not None and status == 200:
                    target.answers[body_index] = connection.last_body
                if progress:
                    progress(len(results))
            wait_s = connection.last_retry_after_s
            if status == 503 and on_refusal == "retry-after" and wait_s is not None:
                time.sleep(max(0.0, min(wait_s, deadline - time.perf_counter())))
        connection.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report = summarize("closed loop", results, time.perf_counter() - started)
    report.extra["clients"] = clients
    report.extra["on_refusal"] = on_refusal
    report.extra["refused_per_s"] = round(sum(result.status == 503 for result in results)
                                          / max(report.duration_s, 1e-9), 1)
    return report


def run_open_loop(target: LoadTarget, rate_rps: float, duration_s: float, max_requests: int,
                  max_in_flight: int = 256, seed: int = 0, progress: Progress | None = None,
                  stop: threading.Event | None = None, results: list[Result] | None = None,
                  started: float | None = None) -> Report:
    """Poisson arrivals at `rate_rps`; up to `max_in_flight` requests outstanding at once.
    `stop` ends the arrivals early; `results` receives every request's Result; `started`
    (time.perf_counter()) is the time the schedule counts from (default: now)."""
    schedule = poisson_schedule(rate_rps, duration_s, seed)[:max_requests]
    pending: queue.Queue[tuple[int, float] | None] = queue.Queue()
    results = [] if results is None else results
    lock = threading.Lock()
    started = time.perf_counter() if started is None else started

    def worker() -> None:
        connection = target.connection()
        while (job := pending.get()) is not None:
            index, due = job
            wait_ms = (time.perf_counter() - started - due) * 1000
            status = connection.post(target.bodies[index % len(target.bodies)])
            with lock:
                results.append(Result(due, (time.perf_counter() - started - due) * 1000, status,
                                      wait_ms, connection.last_version))
                if progress:
                    progress(len(results))
        connection.close()

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(max_in_flight)]
    for thread in workers:
        thread.start()
    for index, due in enumerate(schedule):
        delay = started + due - time.perf_counter()
        if stop is not None and stop.wait(max(delay, 0.0)):
            break
        if stop is None and delay > 0:
            time.sleep(delay)
        pending.put((index, due))
    for _ in workers:
        pending.put(None)
    for thread in workers:
        thread.join()
    report = summarize("open loop", results, time.perf_counter() - started, offered_rps=rate_rps)
    waits = [r.wait_ms for r in results]
    report.extra["client_wait_ms_p99"] = latency_summary(waits)["p99"]
    report.extra["started_over_10ms_late"] = sum(w > 10 for w in waits)
    return report


# --- the client's own ceiling -------------------------------------------------------------------
class KeepAliveHandler(BaseHTTPRequestHandler):
    """A request handler for the lab's local servers: HTTP/1.1 keep-alive, no Nagle delay, no
    log line per request."""

    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args: object) -> None:
        pass


class _InstantHandler(KeepAliveHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"[]")


class LabHTTPServer(ThreadingHTTPServer):
    """The lab's local HTTP servers: a thread per connection, and a listen backlog deep enough
    for an open-loop burst (the standard library's 5 refuses connections when the accepting
    thread is slow to run on a busy machine, which the load generator would count as errors)."""

    request_queue_size = 1024
    daemon_threads = True

    def serve_in_background(self) -> None:
        """Serve from a daemon thread, polled every 50 ms, not socketserver's 0.5 s: `shutdown`
        waits for the next poll."""
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


def instant_server() -> tuple[ThreadingHTTPServer, str]:
    """A local server that answers every POST at once (to measure the client, not a model)."""
    server = LabHTTPServer(("127.0.0.1", 0), _InstantHandler)
    server.serve_in_background()
    return server, f"http://127.0.0.1:{server.server_address[1]}/predictions/instant"
