"""Batching policies at every load, measured in one run on the live server, with the same photo,
and where a lone request's time goes.

Policies (the served version's archive, registered again under names of their own, same workers):

- `frontend_d<ms>`: TorchServe's frontend batching, up to the served batch size, waiting up to
  `<ms>` for company (0, 1 and 5 ms by default). In TorchServe 0.12 a delay of 0 caps batches at
  2 and a delay of 1 ms drains whatever is queued, then waits at most 1 ms (docs/benchmarks.md);
- `batch1`: batch size 1, no delay;
- `queued`: the frontend agent's queued batching: what is queued when a worker is free, up to
  the served batch size, never waiting (torchserve_vision/frontend);
- `continuous`: TorchServe's asynchronous worker mode, the worker batching whatever has arrived
  (handlers/continuous_serving.py; lab only: see docs/benchmarks.md for why);
- `single_session`: one shared session of our own engine (the archive's handler path, JPEG bytes
  to JSON) behind a plain threaded HTTP server in this process, each request run alone as it
  arrives: no TorchServe, no queue, no batching. It isolates what the serving layer adds or costs.

References for one client: `echo` and `echo_async` (a handler that does no work, in each worker
mode: what the server alone costs a request) and the archive's handler path in this process at
batch 1 (`in_process_batch1_ms`). Goal: a policy's one-client p50 within 1 ms of
in-process batch 1 + echo.

Closed loop at each number of clients after a warm-up; with `--open-loop`, Poisson arrivals at
those fractions of the capacity (the best throughput measured at the largest client count).

    bash scripts/demo.sh
    torchserve-vision lab policies --clients 1 4 16 --duration 8 --open-loop 0.25 0.5 0.9 1.2
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from torchserve_vision.archives.versions import archive_manifest, archive_with_version
from torchserve_vision.client import ManagementError, TorchServeClient
from torchserve_vision.lab.compare import register, unregister_all
from torchserve_vision.lab.echo_archive import ECHO, ECHO_ASYNC, build_echo_archive
from torchserve_vision.lab.loadgen import (
    LoadTarget,
    Report,
    run_closed_loop,
    run_open_loop,
)
from torchserve_vision.lab.profile import median_ms
from torchserve_vision.lab.single_session import engine_answer, single_session_handler, threaded_server
from torchserve_vision.local_handler import LocalContext, extract_archive, load_handler
from torchserve_vision.model_descriptions import DELAYED, QUEUED, ServingSettings
from torchserve_vision.server_state import served_default_version, versions_of

POLICY_PREFIX = "policy_"
FRONTEND_DELAYS_MS = (0, 1, 5)
SINGLE_SESSION = "single_session"


def continuous_archive(store: Path, archive: str, max_batch_size: int, max_queued: int = 100) -> str:
    """`archive` copied as version `<v>-cb` with continuous batching on (in the model store)."""
    version = f"{archive_manifest(store / archive)['modelVersion']}-cb"
    return archive_with_version(store, archive, version,
                                handler_changes={"continuous_batching": {
                                    "max_batch_size": max_batch_size, "max_queued": max_queued}},
                                frontend_changes={"asyncCommunication": True,
                                                  "continuousBatching": False})


def archive_batching(store: Path, archive: str, batching: str) -> str:
    """`archive` copied as version `<v>-<batching>` with that frontend batching policy."""
    version = f"{archive_manifest(store / archive)['modelVersion']}-{batching}"
    return archive_with_version(store, archive, version,
                                frontend_changes={"continuousBatching": batching == QUEUED})


def served_policies(store: Path, archive: str, settings: ServingSettings,
                    delays_ms: Sequence[int]) -> dict[str, tuple[str, ServingSettings]]:
    """Policy name -> (archive, registration settings), the references included."""
    workers = settings.min_workers

    def batching(batch_size: int, delay_ms: int, worker_count: int = workers,
                 policy: str = DELAYED) -> ServingSettings:
        return ServingSettings(batch_size, delay_ms, worker_count, worker_count,
                               settings.response_timeout_s, settings.startup_timeout_s, policy)

    delayed = archive_batching(store, archive, DELAYED)
    policies = {ECHO: (build_echo_archive(store, ECHO), batching(1, 0, 1)),
                ECHO_ASYNC: (build_echo_archive(store, ECHO_ASYNC), batching(1, 0, 1)),
                "batch1": (delayed, batching(1, 0))}
    for delay in delays_ms:
        policies[f"frontend_d{delay}"] = (delayed, batching(settings.batch_size, delay))
    policies[QUEUED] = (archive_batching(store, archive, QUEUED),
                        batching(settings.batch_size, 0, policy=QUEUED))
    policies["continuous"] = (continuous_archive(store, archive, settings.batch_size),
                              batching(1, 0))
    return policies


def in_process_batch1_ms(handler: Any, image: bytes, model_dir: str, repeats: int = 30) -> float:
    """The p50 of the archive's handler path (JPEG bytes to JSON) at batch 1, in this process."""
    def once() -> None:
        handler.handle_batch([{"body": bytearray(image)}],
                             LocalContext(model_dir, {}, {}, request_headers=[{}]))
    return median_ms(once, repeats, synchronize=lambda: None)


def retire(client: TorchServeClient, model: str) -> None:
    """Unregister a policy's model. TorchServe 0.12's asynchronous frontend keeps every answered
    request in its map of jobs in the worker and puts them back in the model's queue when the
    worker stops, so after 100 requests the unregister call answers 500 "Deque full"; the model
    is gone all the same (checked here), but its worker processes were seen to live on (past the
    server's own stop), so any left are ended here."""
    pids = [worker["pid"] for version in versions_of(client, model)
            for worker in version.get("workers", []) if worker.get("pid")]
    try:
        unregister_all(client, model)
    except ManagementError as error:
        if versions_of(client, model):
            raise
        print(f"  {model} unregistered, though TorchServe answered: {error}", file=sys.stderr)
    end_processes(pids)


def end_processes(pids: Sequence[int], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`, any of `pids` still running."""
    alive = [process for process in map(existing_process, pids) if process is not None]
    for process in alive:
        process.terminate()
    _, left = psutil.wait_procs(alive, timeout=timeout_s)
    for process in left:
        process.kill()


def existing_process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def closed_loop(url: str, image: bytes, clients: int, duration_s: float) -> Report:
    target = LoadTarget(url, [image], {"Content-Type": "application/octet-stream"})
    run_closed_loop(target, clients, min(3.0, duration_s), 10**6)  # warm up
    return run_closed_loop(target, clients, duration_s, 10**7)


def open_loop(url: str, image: bytes, rate_rps: float, duration_s: float) -> Report:
    target = LoadTarget(url, [image], {"Content-Type": "application/octet-stream"})
    run_closed_loop(target, 2, 1.0, 10**6)  # warm up
    return run_open_loop(target, rate_rps, duration_s, 10**7)


def row(report: Report) -> dict[str, Any]:
    return {"throughput_rps": report.throughput_rps, "p50_ms": report.latency_ms["p50"],
            "p99_ms": report.latency_ms["p99"], "errors": report.errors}


class PolicyRun:
    """The tables of one run: closed loop by policy and clients, open loop by policy and rate."""

    def __init__(self, image: bytes, duration_s: float) -> None:
        self.image, self.duration_s = image, duration_s
        self.closed: dict[str, dict[int, dict[str, Any]]] = {}
        self.open: dict[str, dict[float, dict[str, Any]]] = {}

    def measure_closed(self, policy: str, url: str, clients: int) -> None:
        report = closed_loop(url, self.image, clients, self.duration_s)
        self.closed.setdefault(policy, {})[clients] = row(report)
        print(f"  {policy}, {clients} clients: {report.table()}", file=sys.stderr, flush=True)

    def measure_open(self, policy: str, url: str, rate_rps: float) -> None:
        report = open_loop(url, self.image, rate_rps, self.duration_s)
        self.open.setdefault(policy, {})[round(rate_rps, 1)] = row(report)
        print(f"  {policy}, open loop {rate_rps:.0f}/s: {report.table()}", file=sys.stderr,
              flush=True)


def compare_policies(client: TorchServeClient, store: Path, model: str, image: bytes,
                     loads: Sequence[int], duration_s: float,
                     delays_ms: Sequence[int] = FRONTEND_DELAYS_MS,
                     open_fractions: Sequence[float] = ()) -> dict[str, Any]:
    current = served_default_version(client, model)
    settings = ServingSettings.of_version(current)
    policies = served_policies(store, current["modelUrl"], settings, delays_ms)
    references, compared = (ECHO, ECHO_ASYNC), [p for p in policies if p not in (ECHO, ECHO_ASYNC)]
    run = PolicyRun(image, duration_s)
    urls = {name: f"{client.inference_url}/predictions/{POLICY_PREFIX}{name}" for name in policies}
    try:
        for name, (archive, registration) in policies.items():
            register(client, store, archive, f"{POLICY_PREFIX}{name}", registration)
        for name in references:
            run.measure_closed(name, urls[name], 1)
        for clients in loads:
            for name in compared:
                run.measure_closed(name, urls[name], clients)
        capacity = max(run.closed[name][max(loads)]["throughput_rps"] for name in compared)
        rates = [fraction * capacity for fraction in open_fractions]
        for rate in rates:
            for name in compared:
                run.measure_open(name, urls[name], rate)
    finally:
        for name in policies:
            retire(client, f"{POLICY_PREFIX}{name}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = extract_archive(store / current["modelUrl"], Path(tmp) / "model")
        handler = load_handler(model_dir, batch_size=1)
        batch1_ms = in_process_batch1_ms(handler, image, str(model_dir))
        with threaded_server(engine_answer(single_session_handler(model_dir), str(model_dir))) as url:
            for clients in loads:
                run.measure_closed(SINGLE_SESSION, url, clients)
            for rate in rates:
                run.measure_open(SINGLE_SESSION, url, rate)
    return {"settings": {"batch_size": settings.batch_size,
                         "served_max_batch_delay_ms": settings.max_batch_delay_ms,
                         "workers": settings.min_workers},
            "in_process_batch1_ms": batch1_ms,
            "closed_loop": run.closed, "open_loop": run.open,
            "goals": goals(run.closed, batch1_ms)}


def goals(closed: dict[str, dict[int, dict[str, Any]]], batch1_ms: float) -> dict[str, Any]:
    """Per policy: one-client p50 over the reference (in-process batch 1 + echo's p50; the goal
    is at most 1 ms), and per load the best of the frontend settings (the best fixed setting) and
    each policy's throughput as a share of it and over the single session."""
    reference = batch1_ms + closed[ECHO][1]["p50_ms"]
    policies = [name for name in closed if name not in (ECHO, ECHO_ASYNC)]
    fixed = [name for name in policies if name.startswith("frontend_") or name == "batch1"]
    found: dict[str, Any] = {"one_client_reference_ms": reference, "p50_over_reference_ms": {},
                             "best_fixed": {}, "share_of_best_fixed": {}, "over_single_session": {}}
    for name in policies:
        if 1 in closed[name]:
            found["p50_over_reference_ms"][name] = closed[name][1]["p50_ms"] - reference
    for clients in closed[policies[0]]:
        best = max(fixed, key=lambda name: closed[name][clients]["throughput_rps"])
        best_rps = closed[best][clients]["throughput_rps"]
        single = closed.get(SINGLE_SESSION, {}).get(clients, {}).get("throughput_rps")
        found["best_fixed"][clients] = best
        for name in policies:
            rps = closed[name][clients]["throughput_rps"]
            found["share_of_best_fixed"].setdefault(name, {})[clients] = rps / max(best_rps, 1e-9)
            if single:
                found["over_single_session"].setdefault(name, {})[clients] = rps / single
    return found


def as_text(result: dict[str, Any]) -> str:
    lines = [f"settings {json.dumps(result['settings'])}; in-process batch 1: "
             f"{result['in_process_batch1_ms']:.2f} ms p50",
             "| policy | load | req/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
    for table, unit in ((result["closed_loop"], "clients"), (result["open_loop"], "req/s offered")):
        for policy, loads in table.items():
            for load, values in loads.items():
                lines.append(f"| {policy} | {load} {unit} | {values['throughput_rps']:.1f} | "
                             f"{values['p50_ms']:.1f} | {values['p99_ms']:.1f} | "
                             f"{values['errors'] or ''} |")
    found = result["goals"]
    lines.append(f"one-client reference (in-process batch 1 + echo): "
                 f"{found['one_client_reference_ms']:.2f} ms")
    lines += [f"  {name}: p50 {over:+.2f} ms over it"
              for name, over in found["p50_over_reference_ms"].items()]
    for clients, best in found["best_fixed"].items():
        shares = ", ".join(f"{name} {share[clients]:.2f}"
                           for name, share in found["share_of_best_fixed"].items())
        lines.append(f"{clients} clients: best fixed setting {best}; share of it: {shares}")
    return "\n".join(lines)
