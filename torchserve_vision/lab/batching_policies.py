"""Batching policies at every load, measured in one run on the live server, with the same photo:

- `frontend`: the model as served (TorchServe's frontend batching: up to batch_size requests,
  waiting up to max_batch_delay for company);
- `continuous`: the same archive with continuous batching (TorchServe's asynchronous worker
  mode: the frontend passes each request on at once, the worker batches whatever has arrived,
  up to the same batch size; see handlers/continuous_serving.py), same workers;
- `single_session`: one shared session of our own engine (the archive's handler path, JPEG
  bytes to JSON, its compiled package where it serves one) behind a plain threaded HTTP server
  in this process, no queue and no batching: each request runs alone as it arrives. It isolates
  what the serving layer adds or costs.

Closed loop at each number of clients, after a warm-up. Prints throughput and p50/p99 per policy
and load, and the ratios the goals are stated in (continuous over single session: p50 at one
client, throughput at 4 and 16).

    bash scripts/demo.sh
    torchserve-vision lab policies --clients 1 4 16 --duration 8
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from torchserve_vision.archives.versions import archive_manifest, archive_with_version
from torchserve_vision.client import ManagementError, TorchServeClient
from torchserve_vision.lab.compare import drive, register, unregister_all
from torchserve_vision.lab.loadgen import KeepAliveHandler, LoadTarget, Report, run_closed_loop
from torchserve_vision.lab.local_handler import LocalContext, extract_archive, load_handler
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.server_state import served_default_version, versions_of

CONTINUOUS_SUFFIX = "_continuous"


def continuous_archive(store: Path, archive: str, max_batch_size: int, max_queued: int = 100) -> str:
    """`archive` copied as version `<v>-cb` with continuous batching on (in the model store)."""
    version = f"{archive_manifest(store / archive)['modelVersion']}-cb"
    return archive_with_version(store, archive, version,
                                handler_changes={"continuous_batching": {
                                    "max_batch_size": max_batch_size, "max_queued": max_queued}},
                                frontend_changes={"asyncCommunication": True})


@contextmanager
def single_session_server(store: Path, archive: str) -> Iterator[str]:
    """The archive's handler in this process behind a threaded HTTP server: every request runs
    `handle_batch` on its own thread as it arrives (no queue, no batching). Yields its URL."""
    with tempfile.TemporaryDirectory() as tmp:
        handler = load_handler(extract_archive(store / archive, Path(tmp) / "model"), batch_size=1)

        class Answer(KeepAliveHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                context = LocalContext(tmp, {}, {}, request_headers=[dict(self.headers)])
                (answer,) = handler.handle_batch([{"body": bytearray(body)}], context)
                self.send_response(context.status(0))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/predictions/single"
        finally:
            server.shutdown()
            server.server_close()


def retire(client: TorchServeClient, model: str) -> None:
    """Unregister the continuous copy. TorchServe 0.12's asynchronous frontend keeps every
    answered request in its map of jobs in the worker and puts them back in the model's queue
    when the worker stops, so after 100 requests the unregister call answers 500 "Deque full";
    the model is gone all the same (checked here)."""
    try:
        unregister_all(client, model)
    except ManagementError as error:
        if versions_of(client, model):
            raise
        print(f"  {model} unregistered, though TorchServe answered: {error}", file=sys.stderr)


def drive_url(url: str, image: bytes, clients: int, duration_s: float) -> Report:
    target = LoadTarget(url, [image], {"Content-Type": "application/octet-stream"})
    run_closed_loop(target, clients, min(3.0, duration_s), 10**6)  # warm up
    return run_closed_loop(target, clients, duration_s, 10**7)


def row(report: Report) -> dict[str, Any]:
    return {"throughput_rps": report.throughput_rps, "p50_ms": report.latency_ms["p50"],
            "p99_ms": report.latency_ms["p99"], "errors": report.errors}


def compare_policies(client: TorchServeClient, store: Path, model: str, image: bytes,
                     loads: Sequence[int], duration_s: float) -> dict[str, Any]:
    current = served_default_version(client, model)
    settings = ServingSettings.of_version(current)
    continuous_model = f"{model}{CONTINUOUS_SUFFIX}"
    archive = continuous_archive(store, current["modelUrl"], settings.batch_size)
    register(client, store, archive, continuous_model,
             ServingSettings(1, 0, settings.min_workers, settings.max_workers,
                             settings.response_timeout_s, settings.startup_timeout_s))
    table: dict[str, dict[int, dict[str, Any]]] = {"frontend": {}, "continuous": {},
                                                   "single_session": {}}
    try:
        for clients in loads:
            table["frontend"][clients] = row(drive(client, model, image, clients, duration_s))
            table["continuous"][clients] = row(drive(client, continuous_model, image, clients,
                                                     duration_s))
    finally:
        retire(client, continuous_model)
    with single_session_server(store, current["modelUrl"]) as url:
        for clients in loads:
            table["single_session"][clients] = row(drive_url(url, image, clients, duration_s))
    return {"settings": {"batch_size": settings.batch_size,
                         "max_batch_delay_ms": settings.max_batch_delay_ms,
                         "workers": settings.min_workers},
            "table": table, "ratios": ratios(table)}


def ratios(table: dict[str, dict[int, dict[str, Any]]]) -> dict[str, float]:
    """Continuous over the single session and over frontend batching, per load: throughput, and
    at one client the p50 difference in ms (negative: continuous answers sooner)."""
    found: dict[str, float] = {}
    for clients, continuous in table["continuous"].items():
        for other in ("single_session", "frontend"):
            found[f"continuous_over_{other}_rps_{clients}"] = (
                continuous["throughput_rps"] / max(table[other][clients]["throughput_rps"], 1e-9))
        if clients == 1:
            for other in ("single_session", "frontend"):
                found[f"continuous_minus_{other}_p50_ms_1"] = (
                    continuous["p50_ms"] - table[other][1]["p50_ms"])
    return found


def as_text(result: dict[str, Any]) -> str:
    lines = [f"settings {json.dumps(result['settings'])}",
             "| policy | clients | req/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
    for policy, loads in result["table"].items():
        for clients, values in loads.items():
            lines.append(f"| {policy} | {clients} | {values['throughput_rps']:.1f} | "
                         f"{values['p50_ms']:.1f} | {values['p99_ms']:.1f} | {values['errors'] or ''} |")
    lines += [f"{name}: {value:.2f}" for name, value in result["ratios"].items()]
    return "\n".join(lines)
