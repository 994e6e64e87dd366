"""Side by side, in one run on one machine, at each number of clients (closed loop, the same
photo): our served handler; TorchServe's built-in `image_classifier` handler serving the same
weights with the same batch settings (and at one worker, its best: it leaves PyTorch one thread
per core); one shared session of our own engine (the archive's handler path behind a plain
threaded HTTP server, no queue); one shared ONNX Runtime session of the same network behind the
same server, with Pillow preprocessing (lab/single_session.py). Each single session runs at one
intra-op thread and at one per core, the best per load kept and named. Prints the table, ours
over each other setup per load, and ours batched / at batch 1, served / in-process (the
in-process handler path of one worker, times the number of workers) and where that gap goes
(busy x batch size x contention, from the workers' batch log lines: see batch_log.py).

    bash scripts/demo.sh            # a running server with the model API on
    torchserve-vision lab compare --clients 1 4 16 --duration 10 --image-size small
    torchserve-vision lab compare --clients 16 --duration 20 --image-size phone --json

The built-in handler's archive is the same EfficientNet-Lite0 weights as TorchScript, with
`--handler image_classifier` (Pillow decode, per-image torchvision transforms); it normalises with
ImageNet's mean/std where the model expects 0.5/0.5, which changes its answers slightly but not
its cost. The extra models are unregistered at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from torchserve_vision.archives import ARCHIVER
from torchserve_vision.archives.versions import archive_manifest
from torchserve_vision.client import TorchServeClient
from torchserve_vision.lab.batch_log import ServedBreakdown, logged_batches, served_breakdown
from torchserve_vision.lab.batch_model import BatchTimeFit
from torchserve_vision.lab.loadgen import LoadTarget, Report, run_closed_loop
from torchserve_vision.lab.profile import median_ms, profile_archive
from torchserve_vision.lab.single_session import (
    engine_answer,
    onnx_session,
    single_session_handler,
    threaded_server,
)
from torchserve_vision.local_handler import extract_archive, load_handler
from torchserve_vision.model_descriptions import ServingSettings, resolve_labels
from torchserve_vision.rollout import wait_for_workers
from torchserve_vision.server_state import served_default_version, versions_of

BUILTIN = "builtin_efficientnet_lite0"
BATCH_ONE = "efficientnet_lite0_batch1"
# The setups of the table.
OURS, OURS_BATCH1 = "ours", "ours_batch1"
SINGLE_SESSION, ONNX_SESSION = "single_session", "onnxruntime_session"


def build_builtin_archive(store: Path) -> str:
    """EfficientNet-Lite0 (the same real weights) as TorchScript for TorchServe's image_classifier."""
    import timm

    from torchserve_vision.archives.pretrained_weights import efficientnet_lite0_state_dict

    name = f"{BUILTIN}.mar"
    if (store / name).is_file():
        return name
    model = timm.create_model("efficientnet_lite0", pretrained=False)
    model.load_state_dict(efficientnet_lite0_state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "model.pt"
        torch.jit.save(torch.jit.trace(model.eval(), torch.zeros(1, 3, 224, 224)), str(program))
        labels = Path(tmp) / "index_to_name.json"
        labels.write_text(json.dumps({str(i): n for i, n in enumerate(resolve_labels("imagenet"))}))
        subprocess.run([str(ARCHIVER), "--model-name", BUILTIN, "--version", "1.0",
                        "--serialized-file", str(program), "--handler", "image_classifier",
                        "--extra-files", str(labels), "--export-path", str(store), "--force"],
                       check=True, capture_output=True)
    return name


def register(client: TorchServeClient, store: Path, archive: str, model_name: str,
             settings: ServingSettings) -> None:
    """Register `archive` under `model_name` (replacing an earlier registration) and wait."""
    version = archive_manifest(store / archive)["modelVersion"]
    unregister_all(client, model_name)
    client.call("POST", "/models", {"url": archive, "model_name": model_name,
                                    "batch_size": settings.batch_size,
                                    "max_batch_delay": settings.max_batch_delay_ms,
                                    "initial_workers": settings.min_workers,
                                    "response_timeout": settings.response_timeout_s,
                                    "synchronous": "false"})
    wait_for_workers(client, model_name, version, settings.min_workers, 300)


def unregister_all(client: TorchServeClient, model_name: str) -> None:
    for version in versions_of(client, model_name):
        client.unregister(model_name, version["modelVersion"])


def drive(url: str, image: bytes, clients: int, duration_s: float,
          window: list[datetime] | None = None, label: str = "") -> Report:
    """Closed-loop load on `url` after a short warm-up; `window` (when given) receives the start
    and end of the measured part, as the server's log clock (this machine's local time) reads
    them."""
    target = LoadTarget(url, [image], {"Content-Type": "application/octet-stream"})
    run_closed_loop(target, clients, min(3.0, duration_s), 10**6)  # warm up
    started = datetime.now()
    report = run_closed_loop(target, clients, duration_s, 10**7)
    if window is not None:
        window[:] = [started, datetime.now()]
    print(f"  {label}, {clients} clients: {report.table()}", file=sys.stderr, flush=True)
    return report


def breakdown_of(model_log: Path, model: str, version: str, window: list[datetime],
                 fit: BatchTimeFit, full_batch: int) -> ServedBreakdown | None:
    """The served / in-process breakdown of `model`'s batches logged within `window`, or None
    when the log is not on this machine (a remote server) or holds no batch lines."""
    if not model_log.is_file():
        return None
    with model_log.open(encoding="utf-8", errors="replace") as lines:
        batches = [batch for batch in logged_batches(lines, model, version)
                   if window[0] <= batch.at <= window[1]]
    window_s = (window[1] - window[0]).total_seconds()
    return served_breakdown(batches, fit, full_batch, window_s) if batches else None


class Measured:
    """Closed-loop reports by setup and number of clients; a setup measured in variants (thread
    counts, worker counts) keeps its best variant per load, and which one it was."""

    def __init__(self) -> None:
        self.reports: dict[str, dict[int, Report]] = {}
        self.variants: dict[str, dict[int, str]] = {}

    def add(self, setup: str, clients: int, report: Report, variant: str = "") -> None:
        best = self.reports.setdefault(setup, {}).get(clients)
        if best is None or report.throughput_rps > best.throughput_rps:
            self.reports[setup][clients] = report
            self.variants.setdefault(setup, {})[clients] = variant

    def rps(self, setup: str, clients: int) -> float:
        return self.reports[setup][clients].throughput_rps

    def table(self) -> dict[str, dict[int, dict[str, Any]]]:
        return {setup: {clients: {"throughput_rps": report.throughput_rps,
                                  "p50_ms": report.latency_ms["p50"],
                                  "p99_ms": report.latency_ms["p99"],
                                  "errors": report.errors,
                                  **({"best_of": self.variants[setup][clients]}
                                     if self.variants[setup][clients] else {})}
                        for clients, report in by_clients.items()}
                for setup, by_clients in self.reports.items()}


def measure_served(client: TorchServeClient, store: Path, model: str, settings: ServingSettings,
                   image: bytes, loads: Sequence[int], duration_s: float,
                   measured: Measured) -> list[datetime]:
    """Ours (the served default version), the built-in handler (at the same workers and at one,
    its best: it leaves PyTorch one thread per core) and ours at batch 1 (at the most clients).
    Returns the measured window of ours at the most clients (for the breakdown)."""
    register(client, store, build_builtin_archive(store), BUILTIN, settings)
    register(client, store, served_default_version(client, model)["modelUrl"], BATCH_ONE,
             replace(settings, batch_size=1, max_batch_delay_ms=0))
    url = client.prediction_url
    window: list[datetime] = []
    try:
        for clients in loads:
            chosen = window if clients == max(loads) else None
            measured.add(OURS, clients, drive(url(model), image, clients, duration_s, chosen, OURS))
            measured.add(BUILTIN, clients, drive(url(BUILTIN), image, clients, duration_s,
                                                 label=BUILTIN), f"{settings.min_workers} workers")
        measured.add(OURS_BATCH1, max(loads), drive(url(BATCH_ONE), image, max(loads), duration_s,
                                                    label=OURS_BATCH1))
        if settings.min_workers > 1:
            client.scale(BUILTIN, "1.0", 1, 1)
            for clients in loads:
                measured.add(BUILTIN, clients, drive(url(BUILTIN), image, clients, duration_s,
                                                     label=f"{BUILTIN} (1 worker)"), "1 worker")
    finally:
        for name in (BUILTIN, BATCH_ONE):
            unregister_all(client, name)
    return window


def measure_single_sessions(archive: Path, image: bytes, loads: Sequence[int], duration_s: float,
                            measured: Measured) -> float:
    """One shared session of our engine and of ONNX Runtime, each behind a threaded server, at
    1 and at one intra-op thread per core, the best per load kept. Returns the in-process batch-1
    handler path's p50 (ms) at the archive's own thread count."""
    thread_counts = sorted({1, os.cpu_count() or 1})
    archive_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = extract_archive(archive, Path(tmp) / "model")
        handler = load_handler(model_dir, batch_size=1)
        batch1_ms = median_ms(lambda: engine_answer(handler, str(model_dir))(image, {}), 30,
                              synchronize=lambda: None)
        try:
            for threads in thread_counts:
                session = single_session_handler(model_dir, threads)
                with threaded_server(engine_answer(session, str(model_dir))) as url:
                    for clients in loads:
                        measured.add(SINGLE_SESSION, clients,
                                     drive(url, image, clients, duration_s,
                                           label=f"{SINGLE_SESSION} ({threads} threads)"),
                                     f"{threads} threads")
        finally:
            torch.set_num_threads(archive_threads)
        with onnx_session(model_dir) as answer_with:
            for threads in thread_counts:
                with threaded_server(answer_with(threads)) as url:
                    for clients in loads:
                        measured.add(ONNX_SESSION, clients,
                                     drive(url, image, clients, duration_s,
                                           label=f"{ONNX_SESSION} ({threads} threads)"),
                                     f"{threads} threads")
    return batch1_ms


def compare(client: TorchServeClient, store: Path, model: str, image: bytes,
            loads: Sequence[int], duration_s: float, model_log: Path) -> dict[str, Any]:
    current = served_default_version(client, model)
    settings = ServingSettings.of_version(current)
    measured = Measured()
    window = measure_served(client, store, model, settings, image, loads, duration_s, measured)
    batch1_ms = measure_single_sessions(store / current["modelUrl"], image, loads, duration_s,
                                        measured)
    profile = profile_archive(store / current["modelUrl"], settings.batch_size, 5, image, "benchmark")
    # The in-process path is one worker's; the server runs `min_workers` of them.
    in_process_rps = profile.throughput_rps("handler", settings.batch_size) * settings.min_workers
    most = max(loads)
    breakdown = breakdown_of(model_log, model, current["modelVersion"], window,
                             profile.handler_fit, settings.batch_size)
    ours = measured.reports[OURS]
    return {
        "settings": asdict(settings), "loads": list(loads), "table": measured.table(),
        "ours_over": {other: {clients: ours[clients].throughput_rps / measured.rps(other, clients)
                              for clients in loads}
                      for other in (BUILTIN, SINGLE_SESSION, ONNX_SESSION)},
        "in_process_handler_rps": in_process_rps,
        "in_process_model_batching_gain": profile.throughput_rps("model", settings.batch_size)
        / profile.throughput_rps("model", 1),
        "in_process_batch1_handler_ms": batch1_ms,
        "served_breakdown": asdict(breakdown) if breakdown else None,
        "ratios": {
            "batched_over_batch1": ours[most].throughput_rps / measured.rps(OURS_BATCH1, most),
            "served_over_in_process": ours[most].throughput_rps / in_process_rps,
            **({"one_client_p50_minus_in_process_batch1_ms": ours[1].latency_ms["p50"] - batch1_ms}
               if 1 in ours else {}),
        },
    }


def as_text(result: dict[str, Any]) -> str:
    """The table (req/s and p50 per setup and load; the best variant in brackets), then ours
    over each other setup per load, and the ratios."""
    table, loads = result["table"], result["loads"]
    lines = ["| setup | " + " | ".join(f"{c} clients: req/s (p50 ms)" for c in loads) + " |",
             "|---|" + "---|" * len(loads)]
    for setup, by_clients in table.items():
        cells = []
        for clients in loads:
            row = by_clients.get(str(clients), by_clients.get(clients))
            cells.append("" if row is None else
                         f"{row['throughput_rps']:.1f} ({row['p50_ms']:.1f})"
                         + (f" [{row['best_of']}]" if row.get("best_of") else ""))
        lines.append(f"| {setup} | " + " | ".join(cells) + " |")
    for other, by_clients in result["ours_over"].items():
        shares = ", ".join(f"{clients} clients {value:.2f}x" for clients, value in by_clients.items())
        lines.append(f"ours / {other}: {shares}")
    lines.append(f"in-process handler path at batch {result['settings']['batch_size']}: "
                 f"{result['in_process_handler_rps']:.1f} img/s; model batching gain in-process "
                 f"{result['in_process_model_batching_gain']:.2f}x; batch 1 "
                 f"{result['in_process_batch1_handler_ms']:.2f} ms")
    lines += [f"{name}: {value:.2f}" for name, value in result["ratios"].items()]
    if result["served_breakdown"]:
        lines.append(ServedBreakdown(**result["served_breakdown"]).table())
    return "\n".join(lines)
