"""Sweep batch size x max batch delay (x workers) for a model on a running TorchServe.

For each combination the model is rolled out with those settings (a new version of the same
archive, swapped in without downtime (see rollout.py)), driven by the load generator at each
load level, and measured. Results go to <out>.json, <out>.csv and <out>.png (throughput vs p99,
one curve per setting, the SLA line, the chosen operating point marked). The original settings
are restored at the end.

    torchserve-vision lab sweep --model efficientnet_lite0 --batch-sizes 1 4 8 --delays 5 20 \\
        --clients 1 4 16 32 --duration 8 --sla-ms 500 --out docs/sweep-cpu
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from itertools import product
from pathlib import Path

from torchserve_vision.archives.versions import archive_with_version, settings_version
from torchserve_vision.client import TorchServeClient
from torchserve_vision.lab.loadgen import LoadTarget, run_closed_loop
from torchserve_vision.model_descriptions import QUEUED, ServingSettings
from torchserve_vision.rollout import RolloutError, RolloutPlan, rollout
from torchserve_vision.server_state import default_version, served_default_version


@dataclass(frozen=True)
class SweepPoint:
    batch_size: int
    max_batch_delay_ms: int
    workers: int
    clients: int
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    errors: int


def choose_operating_point(points: Sequence[SweepPoint], sla_ms: float) -> SweepPoint | None:
    """The highest-throughput point whose p99 meets the SLA and had no errors (None if none)."""
    meeting = [p for p in points if p.p99_ms <= sla_ms and p.errors == 0]
    return max(meeting, key=lambda p: (p.throughput_rps, -p.p99_ms)) if meeting else None


def apply_settings(client: TorchServeClient, model: str, store: Path, settings: ServingSettings,
                   smoke_image: bytes) -> None:
    """Roll the model's current archive out with `settings` (a new version of the same archive)."""
    current = served_default_version(client, model)
    if ServingSettings.of_version(current) == settings:
        return
    version = settings_version(current["modelVersion"], settings)
    archive = archive_with_version(store, current["modelUrl"], version,
                                   frontend_changes={"continuousBatching": settings.batching == QUEUED})
    rollout(client, RolloutPlan(model, archive, settings, smoke_image), store, lambda _m: None)


def measure(target: LoadTarget, settings: ServingSettings, clients: Sequence[int],
            duration_s: float) -> list[SweepPoint]:
    run_closed_loop(target, clients=max(clients), duration_s=1.0, max_requests=10**6)  # warm up
    points = []
    for count in clients:
        report = run_closed_loop(target, clients=count, duration_s=duration_s, max_requests=10**7)
        points.append(SweepPoint(settings.batch_size, settings.max_batch_delay_ms, settings.min_workers,
                                 count, report.throughput_rps, report.latency_ms["p50"],
                                 report.latency_ms["p99"], report.sent - report.succeeded))
        print(f"  B={settings.batch_size} d={settings.max_batch_delay_ms} W={settings.min_workers} "
              f"clients={count}: {report.throughput_rps:.1f} req/s, p99 {report.latency_ms['p99']:.0f} ms",
              file=sys.stderr, flush=True)
    return points


def write_results(points: Sequence[SweepPoint], chosen: SweepPoint | None, sla_ms: float, out: Path,
                  title: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"sla_ms": sla_ms, "chosen": asdict(chosen) if chosen else None,
                "points": [asdict(p) for p in points]}
    out.with_suffix(".json").write_text(json.dumps(document, indent=2))
    with out.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(points[0])))
        writer.writeheader()
        writer.writerows(asdict(p) for p in points)
    plot(points, chosen, sla_ms, out.with_suffix(".png"), title)


def plot(points: Sequence[SweepPoint], chosen: SweepPoint | None, sla_ms: float, path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    curves = sorted({(p.batch_size, p.max_batch_delay_ms, p.workers) for p in points})
    for batch, delay, workers in curves:
        curve = sorted((p for p in points if (p.batch_size, p.max_batch_delay_ms, p.workers)
                        == (batch, delay, workers)), key=lambda p: p.clients)
        axes.plot([p.throughput_rps for p in curve], [p.p99_ms for p in curve], marker="o",
                  label=f"batch {batch}, delay {delay} ms" + (f", {workers} workers" if workers > 1 else ""))
    axes.axhline(sla_ms, color="red", linestyle="--", label=f"p99 SLA {sla_ms:.0f} ms")
    if chosen:
        axes.plot([chosen.throughput_rps], [chosen.p99_ms], marker="*", markersize=18, color="gold",
                  markeredgecolor="black", linestyle="none",
                  label=f"chosen: batch {chosen.batch_size}, delay {chosen.max_batch_delay_ms} ms, "
                        f"{chosen.clients} clients")
    axes.set_xlabel("throughput (requests/s)")
    axes.set_ylabel("p99 latency (ms)")
    axes.set_yscale("log")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)



def run_sweep(client: TorchServeClient, model: str, store: Path, batch_sizes: Sequence[int],
              delays_ms: Sequence[int], workers: Sequence[int], clients: Sequence[int],
              duration_s: float, image: bytes) -> list[SweepPoint]:
    """Measure every combination of settings at every load level; the model's original settings
    are rolled back in at the end, whatever happened."""
    original = default_version(client, model)
    if original is None:
        raise RolloutError(f"{model} is not registered on {client.management_url}")
    original_settings = ServingSettings.of_version(original)
    if original_settings.batching == QUEUED and set(delays_ms) != {0}:
        print(f"  {model} batches queued (it never waits): sweeping batch sizes and workers, "
              "not delays", file=sys.stderr)
        delays_ms = [0]
    target = LoadTarget(client.prediction_url(model), [image], client.inference_headers())
    points: list[SweepPoint] = []
    try:
        for batch, delay, count in product(batch_sizes, delays_ms, workers):
            settings = replace(original_settings, batch_size=batch, max_batch_delay_ms=delay,
                               min_workers=count, max_workers=count)
            apply_settings(client, model, store, settings, image)
            points += measure(target, settings, clients, duration_s)
    finally:
        current = default_version(client, model)
        if current is not None and ServingSettings.of_version(current) != original_settings:
            rollout(client, RolloutPlan(model, original["modelUrl"], original_settings, image),
                    store, lambda _m: None)
    return points


def points_table(points: Sequence[SweepPoint]) -> str:
    return "\n".join(f"B={p.batch_size:<3d} d={p.max_batch_delay_ms:<4d} W={p.workers} "
                     f"clients={p.clients:<3d} {p.throughput_rps:7.1f} req/s  p50 {p.p50_ms:7.1f} ms  "
                     f"p99 {p.p99_ms:7.1f} ms  errors {p.errors}" for p in points)
