"""Side by side, in one run on one machine: our handler vs TorchServe's built-in `image_classifier`
handler serving the same weights with the same batch settings, vs our handler at batch size 1,
vs our handler path in-process (no server). Prints the ratios:
ours / built-in, batched / batch-1, served / in-process (the in-process handler path of one
worker, times the number of workers), and where the served / in-process gap goes (busy x batch
size x contention, from the workers' batch log lines: see batch_log.py).

    bash scripts/demo.sh            # a running server with the model API on
    torchserve-vision lab compare --clients 16 --duration 20 --image-size small
    torchserve-vision lab compare --clients 16 --duration 20 --image-size phone --json

The built-in handler's archive is the same EfficientNet-Lite0 weights as TorchScript, with
`--handler image_classifier` (Pillow decode, per-image torchvision transforms); it normalises with
ImageNet's mean/std where the model expects 0.5/0.5, which changes its answers slightly but not
its cost. The extra models are unregistered at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
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
from torchserve_vision.lab.profile import profile_archive
from torchserve_vision.model_descriptions import ServingSettings, resolve_labels
from torchserve_vision.rollout import wait_for_workers
from torchserve_vision.server_state import served_default_version, versions_of

BUILTIN = "builtin_efficientnet_lite0"
BATCH_ONE = "efficientnet_lite0_batch1"


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


def drive(client: TorchServeClient, model: str, image: bytes, clients: int, duration_s: float,
          window: list[datetime] | None = None) -> Report:
    """Closed-loop load after a short warm-up; `window` (when given) receives the start and end
    of the measured part, as the server's log clock (this machine's local time) reads them."""
    target = LoadTarget(f"{client.inference_url}/predictions/{model}", [image])
    run_closed_loop(target, clients, min(3.0, duration_s), 10**6)  # warm up
    started = datetime.now()
    report = run_closed_loop(target, clients, duration_s, 10**7)
    if window is not None:
        window[:] = [started, datetime.now()]
    print(f"  {model}, {clients} clients: {report.table()}", file=sys.stderr, flush=True)
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


def compare(client: TorchServeClient, store: Path, model: str, image: bytes, clients: int,
            duration_s: float, model_log: Path) -> dict[str, Any]:
    current = served_default_version(client, model)
    settings = ServingSettings.of_version(current)
    builtin_archive = build_builtin_archive(store)
    register(client, store, builtin_archive, BUILTIN, settings)
    register(client, store, current["modelUrl"], BATCH_ONE,
             ServingSettings(1, 0, settings.min_workers, settings.max_workers, settings.response_timeout_s))
    ours_window: list[datetime] = []
    try:
        reports = {"ours": drive(client, model, image, clients, duration_s, ours_window),
                   "builtin": drive(client, BUILTIN, image, clients, duration_s),
                   "ours_batch1": drive(client, BATCH_ONE, image, clients, duration_s),
                   "ours_one_client": drive(client, model, image, 1, duration_s),
                   "builtin_one_client": drive(client, BUILTIN, image, 1, duration_s)}
        if settings.min_workers > 1:
            # The built-in handler leaves PyTorch at one thread per core, so several workers
            # oversubscribe the CPU; give it its best worker count as well.
            client.scale(BUILTIN, "1.0", 1, 1)
            reports["builtin_1_worker"] = drive(client, BUILTIN, image, clients, duration_s)
    finally:
        for name in (BUILTIN, BATCH_ONE):
            unregister_all(client, name)
    profile = profile_archive(store / current["modelUrl"], settings.batch_size, 5, image, "benchmark")
    # The in-process path is one worker's; the server runs `min_workers` of them.
    in_process_rps = profile.throughput_rps("handler", settings.batch_size) * settings.min_workers
    in_process_one_ms = profile.handler_ms[0]
    ours = reports["ours"].throughput_rps
    breakdown = breakdown_of(model_log, model, current["modelVersion"], ours_window,
                             profile.handler_fit, settings.batch_size)
    return {
        "settings": asdict(settings), "clients": clients,
        "throughput_rps": {name: report.throughput_rps for name, report in reports.items()},
        "p50_ms": {name: report.latency_ms["p50"] for name, report in reports.items()},
        "p99_ms": {name: report.latency_ms["p99"] for name, report in reports.items()},
        "errors": {name: report.errors for name, report in reports.items() if report.errors},
        "in_process_handler_rps": in_process_rps,
        "in_process_model_batching_gain": profile.throughput_rps("model", settings.batch_size)
        / profile.throughput_rps("model", 1),
        "in_process_batch1_handler_ms": in_process_one_ms,
        "served_breakdown": asdict(breakdown) if breakdown else None,
        "ratios": {
            "ours_over_builtin": ours / max(report.throughput_rps for name, report in reports.items()
                                            if name in ("builtin", "builtin_1_worker")),
            "ours_over_builtin_same_workers": ours / reports["builtin"].throughput_rps,
            "batched_over_batch1": ours / reports["ours_batch1"].throughput_rps,
            "served_over_in_process": ours / in_process_rps,
            "one_client_p50_minus_in_process_batch1_ms":
                reports["ours_one_client"].latency_ms["p50"] - in_process_one_ms,
        },
    }
