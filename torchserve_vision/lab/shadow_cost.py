"""`lab shadow`: is the online comparison right, and what does shadowing cost production?

1. Agreement offline and online on the same inputs: every photo of scikit-image's data folder
   (39, colour and grayscale) answered in this process by the served archive's handler and the
   candidate's (batch 1, as TorchServe would call them), compared with the handler's own
   comparer; then the same photos sent once each to the live model with the shadow at 100%,
   and the agreement read from the workers' metrics (the delta over those requests).
2. The cost on production: open-loop Poisson arrivals at `--rate` on the model's default
   version with the shadow at each of `--percents` (0: off), same run: production's p50 / p99,
   served rate, errors, copies compared and dropped.

The candidate is an archive in the model store (`--candidate`), or the served archive with
another precision (`--candidate-precision fp32`: a copy whose handler serves that package).

    bash scripts/demo.sh
    torchserve-vision lab shadow --candidate-precision fp32 --rate 40 --duration 20 --percents 0 5 20
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import requests

from torchserve_vision.archives.versions import archive_manifest, archive_with_version
from torchserve_vision.client import TorchServeClient
from torchserve_vision.lab.loadgen import LoadTarget, run_open_loop
from torchserve_vision.local_handler import archive_context, extract_archive, load_handler
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.photos import all_photo_paths
from torchserve_vision.prometheus_text import scrape
from torchserve_vision.server_state import served_default_version
from torchserve_vision.shadow import (
    ShadowPlan,
    ShadowTotals,
    shadow_totals,
    start_shadow,
    stop_shadow,
)
from torchserve_vision.waiting import wait_until


def local_answers(model_dir: Path, photos: Sequence[bytes]) -> list[Any]:
    """Each photo answered alone by the extracted archive's handler, as JSON."""
    handler = load_handler(model_dir, batch_size=1)
    return [json.loads(handler.handle_batch([{"body": bytearray(photo)}],
                                            archive_context(model_dir, 1, [{}]))[0])
            for photo in photos]


def offline_agreement(store: Path, stable: str, candidate: str, photos: Sequence[bytes]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stable_dir = extract_archive(store / stable, Path(tmp) / "stable")
        ours = local_answers(stable_dir, photos)
        theirs = local_answers(extract_archive(store / candidate, Path(tmp) / "candidate"), photos)
        comparer = load_handler(stable_dir, batch_size=1).compare_answers
    return sum(comparer(a, b).agreement for a, b in zip(ours, theirs, strict=True)) / len(photos)


def counters_of(metrics_url: str, model: str, candidate: str) -> Callable[[], ShadowTotals]:
    """The workers' shadow counters for the candidate, read from TorchServe's /metrics."""
    return lambda: shadow_totals(scrape(metrics_url), model, candidate)


def settled(counters: Callable[[], ShadowTotals], quiet_s: float = 2.0,
            timeout_s: float = 60.0) -> ShadowTotals:
    """The counters once the copies sent so far have met their fate: compared off the request
    path, they are counted after production's answers, a batch later on a loaded machine. Read
    until two reads `quiet_s` apart agree (at most `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    last = counters()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = counters()
        if now == last:
            return now
        last = now
    return last


def online_agreement(client: TorchServeClient, model: str, photos: Sequence[bytes],
                     counters: Callable[[], ShadowTotals]) -> float:
    before = counters()
    with requests.Session() as session:
        for photo in photos:
            session.post(client.prediction_url(model), data=photo, timeout=60,
                         headers={"Content-Type": "application/octet-stream",
                                  **client.inference_headers()}).raise_for_status()
    wait_until(lambda: counters().compared - before.compared >= len(photos), 60,
               f"{len(photos)} copies compared")
    after = counters()
    return (after.agreed - before.agreed) / (after.compared - before.compared)


def candidate_archive(store: Path, served_archive: str, candidate: str | None,
                      precision: str | None) -> str:
    if candidate:
        return candidate
    if precision is None:
        raise ValueError("give --candidate or --candidate-precision")
    version = f"{archive_manifest(store / served_archive)['modelVersion']}-{precision}"
    return archive_with_version(store, served_archive, version,
                                handler_changes={"precision": precision})


def measure(client: TorchServeClient, store: Path, model: str, metrics_url: str, image: bytes,
            candidate: str | None, precision: str | None, rate_rps: float, duration_s: float,
            percents: Sequence[float]) -> dict[str, Any]:
    served = served_default_version(client, model)
    archive = candidate_archive(store, served["modelUrl"], candidate, precision)
    settings = ServingSettings.of_version(served)
    plan = ShadowPlan(model, archive, 100.0, settings, image)
    photos = [path.read_bytes() for path in all_photo_paths()]
    result: dict[str, Any] = {"model": model, "stable": served["modelVersion"], "candidate": archive,
                              "photos": len(photos), "rate_rps": rate_rps, "duration_s": duration_s}
    result["offline_agreement"] = offline_agreement(store, served["modelUrl"], archive, photos)
    policy = start_shadow(client, plan, store, lambda line: None)
    counters = counters_of(metrics_url, model, policy.candidate_version)
    try:
        result["online_agreement"] = online_agreement(client, model, photos, counters)
        result["cost"] = [shadow_cost(client, store, plan, counters, percent, rate_rps, duration_s)
                          for percent in percents]
    finally:
        stop_shadow(client, model, retire=True, log=lambda line: None)
    return result


def shadow_cost(client: TorchServeClient, store: Path, plan: ShadowPlan,
                counters: Callable[[], ShadowTotals],
                percent: float, rate_rps: float, duration_s: float) -> dict[str, Any]:
    """Production under open loop with the shadow at `percent` (0: off), and the copies' fate."""
    if percent > 0:
        start_shadow(client, ShadowPlan(plan.model, plan.archive, percent, plan.settings,
                                        plan.smoke_image), store, lambda line: None)
    else:
        stop_shadow(client, plan.model, retire=False, log=lambda line: None)
    before = counters()
    target = LoadTarget(client.prediction_url(plan.model), [plan.smoke_image],
                        {"Content-Type": "application/octet-stream", **client.inference_headers()})
    report = run_open_loop(target, rate_rps, duration_s, 10**7)
    after = settled(counters)
    return {"percent": percent, "served_rps": report.throughput_rps, "errors": report.errors,
            "p50_ms": report.latency_ms["p50"], "p99_ms": report.latency_ms["p99"],
            "compared": after.compared - before.compared,
            "dropped": after.dropped - before.dropped}


def as_text(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} {result['stable']} vs {result['candidate']}, "
             f"{result['photos']} photos: agreement offline {result['offline_agreement']:.4f}, "
             f"online {result['online_agreement']:.4f}",
             f"production under {result['rate_rps']:g} req/s open loop, {result['duration_s']:g} s "
             "per setting:",
             "| shadow | served req/s | p50 ms | p99 ms | errors | copies compared | dropped |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {row['percent']:g}% | {row['served_rps']:.1f} | {row['p50_ms']:.1f} | "
              f"{row['p99_ms']:.1f} | {sum(row['errors'].values())} | {row['compared']:.0f} | "
              f"{row['dropped']:.0f} |" for row in result["cost"]]
    return "\n".join(lines)
