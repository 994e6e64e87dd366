"""What each way in costs: one `server run` with the front and the gRPC front, the same photo
classified with Triton's client libraries three ways, interleaved in rounds so that each way
meets the same machine:

- `http direct`: tritonclient.http on TorchServe's inference address;
- `http front`: tritonclient.http through the front (HAProxy);
- `grpc front`: tritonclient.grpc through the gRPC front (translated onto the front).

    torchserve-vision lab protocols --clients 1 16 --duration 8 --rounds 2

Each client is a thread with a client object of its own, sending the next request when the last
is answered (closed loop); the binary tensor extension on HTTP, raw_input_contents on gRPC.
Reported per way and client count: requests per second and p50 latency of every round.
"""

from __future__ import annotations

import importlib
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from torchserve_vision.lab.loadgen import latency_summary
from torchserve_vision.lab.pods import Pod
from torchserve_vision.torchserve_config import free_ports, server_config

WAYS = ("http direct", "http front", "grpc front")
Call = Callable[[], None]


@dataclass
class WayFigures:
    way: str
    clients: int
    rps: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)


def triton_call(protocol: str, address: str, model: str, image: bytes) -> Call:
    """One classification call with tritonclient's `protocol` module ("http" or "grpc": the
    same API), on a client of its own."""
    triton = importlib.import_module(f"tritonclient.{protocol}")
    client = triton.InferenceServerClient(address)
    tensor = triton.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    return lambda: client.infer(model, [tensor]) and None


def closed_loop(make_call: Callable[[], Call], clients: int, duration_s: float) -> tuple[float, float]:
    """(answers per second, p50 ms) of `clients` threads calling for `duration_s`. Each thread
    makes its own client (tritonclient.http's gevent sockets stay with the thread that made
    them) and calls once before the clock starts."""
    latencies: list[float] = []
    lock = threading.Lock()
    window: list[float] = []      # the deadline, set as every client is ready
    ready = threading.Barrier(clients + 1, action=lambda: window.append(time.perf_counter() + duration_s))

    def client() -> None:
        call = make_call()
        call()
        ready.wait()
        while time.perf_counter() < window[0]:
            sent = time.perf_counter()
            call()
            with lock:
                latencies.append((time.perf_counter() - sent) * 1000)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    ready.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return len(latencies) / (time.perf_counter() - started), latency_summary(latencies)["p50"]


def measure(config: Path, model_store: Path, model: str, image: bytes, client_counts: list[int],
            duration_s: float, rounds: int, on_step: Callable[[str], None] = lambda line: None
            ) -> list[WayFigures]:
    with tempfile.TemporaryDirectory(prefix="protocols-") as tmp:
        front_port, grpc_port = free_ports(2)
        pod = Pod("protocols", server_config(Path(tmp), model_store, config, load_models=f"{model}-1.0.mar"),
                  Path(tmp) / "run", model_store, drain_delay_s=0.0, front_port=front_port,
                  grpc_front_port=grpc_port)
        with pod.running():
            direct = pod.instance.inference_url.removeprefix("http://")
            makers: dict[str, Callable[[], Call]] = {
                "http direct": lambda: triton_call("http", direct, model, image),
                "http front": lambda: triton_call("http", f"127.0.0.1:{front_port}", model, image),
                "grpc front": lambda: triton_call("grpc", f"127.0.0.1:{grpc_port}", model, image)}
            figures = {(way, clients): WayFigures(way, clients) for clients in client_counts for way in WAYS}
            for round_index in range(rounds):
                for clients in client_counts:
                    for way in WAYS:
                        rps, p50 = closed_loop(makers[way], clients, duration_s)
                        figures[way, clients].rps.append(rps)
                        figures[way, clients].p50_ms.append(p50)
                        on_step(f"round {round_index + 1}, {clients} clients, {way}: {rps:.1f}/s, "
                                f"p50 {p50:.1f} ms")
            return list(figures.values())


def markdown(figures: list[WayFigures]) -> str:
    lines = ["| clients | " + " | ".join(f"{way}: req/s (p50 ms)" for way in WAYS) + " |",
             "|---|" + "---|" * len(WAYS)]
    for clients in sorted({figure.clients for figure in figures}):
        cells = []
        for way in WAYS:
            figure = next(f for f in figures if f.way == way and f.clients == clients)
            cells.append(", ".join(f"{rps:.1f}" for rps in figure.rps)
                         + " (" + ", ".join(f"{p50:.1f}" for p50 in figure.p50_ms) + ")")
        lines.append(f"| {clients} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
