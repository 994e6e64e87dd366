"""Ultralytics exports served against Ultralytics' own `predict`, in one run on one machine: each
export is built into an archive (`build --source ultralytics`), served by a TorchServe of its own
and sent the same JPEGs by closed-loop clients at each load; then Ultralytics' `predict` runs the
same export in this process, one image at a time and in batches, at its best rate.

    torchserve-vision lab ultralytics --weights yolov8n.torchscript yolov8m.torchscript

Printed per export: served images/s and p50 at each client count, Ultralytics' images/s and
per-image latency one at a time and at each batch size, and the two ratios the serving goals are
stated in (served at the most clients over Ultralytics' best rate; one client's p50 over
Ultralytics' latency for one image). Ultralytics (AGPL-3.0) must be installed where the lab runs
(the tests' `requirements-ultralytics.txt`); the server never imports it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchserve_vision import paths
from torchserve_vision.errors import LabError
from torchserve_vision.lab.benchmark_images import jpeg_of
from torchserve_vision.lab.served_loads import served_loads
from torchserve_vision.model_descriptions import ModelDescription, ServingSettings, parse_description
from torchserve_vision.torchserve_config import server_config, write_models_block

# The same JPEGs for every side: the project's photos at sizes around a 640 input.
PHOTO_SIZES = {"astronaut.png": (512, 512), "motorcycle_left.png": (741, 500), "rocket.jpg": (640, 427),
               "coffee.png": (600, 400), "chelsea.png": (451, 300), "motorcycle_right.png": (960, 648)}


@dataclass(frozen=True)
class UltralyticsLabSettings:
    clients: tuple[int, ...] = (1, 4, 16)
    duration_s: float = 10.0
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    serving: ServingSettings = field(default_factory=lambda: ServingSettings(4, 1, 1, 1))
    torch_threads: int | None = None


def lab_jpegs() -> list[bytes]:
    return [jpeg_of(name, size) for name, size in PHOTO_SIZES.items()]


def described(export: Path, name: str, settings: UltralyticsLabSettings) -> ModelDescription:
    from torchserve_vision.archives.ultralytics_exports import read_export

    handler: dict[str, Any] = {}
    if settings.torch_threads is not None:
        handler["torch_threads"] = settings.torch_threads
    serving = settings.serving
    return parse_description({
        "name": name, "task": read_export(export).task, "handler": handler,
        "model": {"source": "ultralytics", "weights": str(export)},
        "serving": {"batch_size": serving.batch_size, "min_workers": serving.min_workers,
                    "max_workers": serving.max_workers}})


def served(export: Path, jpegs: Sequence[bytes], settings: UltralyticsLabSettings,
           work: Path) -> dict[int, dict[str, float]]:
    """The export's archive on a TorchServe of its own: images/s and latency at each load."""
    from torchserve_vision.archives.build import build_archive

    store = work / "store"
    description = described(export, "yolo", settings)
    build_archive(description, store, reference_requests=0)
    config = server_config(work / "server", store, paths.DEVELOPMENT_CONFIG, job_queue_size="1000")
    write_models_block(config, [description])
    return served_loads(config, store, "yolo", jpegs, settings.clients, settings.duration_s, work / "run")


def ultralytics_predict(export: Path, jpegs: Sequence[bytes], settings: UltralyticsLabSettings,
                        work: Path) -> dict[str, Any]:
    """Ultralytics' `predict` on the export in this process: images/s and per-image latency,
    one file at a time and as batches of arrays (decoding included, as predict on a file
    decodes it)."""
    os.environ.setdefault("YOLO_OFFLINE", "true")
    os.environ.setdefault("YOLO_CONFIG_DIR", str(work / "ultralytics-settings"))
    try:
        from ultralytics import YOLO
    except ImportError:
        raise LabError("lab ultralytics measures Ultralytics' own predict: install ultralytics "
                       "where the lab runs (AGPL-3.0; requirements-ultralytics.txt)") from None
    import cv2

    files = []
    for index, data in enumerate(jpegs):
        files.append(work / f"photo-{index}.jpg")
        files[-1].write_bytes(data)
    model: Any = YOLO(str(export))
    for path in files:
        model.predict(str(path), verbose=False)                                    # warm-up
    alone = timed_rounds(lambda: [model.predict(str(path), verbose=False) for path in files],
                         len(files), settings.duration_s)
    results = {"one_at_a_time": alone}
    for batch in settings.batch_sizes:
        def predict_batches(batch: int = batch) -> list[Any]:
            images = [cv2.imread(str(path)) for path in (files * batch)[:batch]]
            return model.predict(images, verbose=False)
        predict_batches()
        results[f"batch_{batch}"] = timed_rounds(predict_batches, batch, settings.duration_s)
    return results


def timed_rounds(call: Any, images_per_call: int, duration_s: float) -> dict[str, float]:
    """`call` repeated for about `duration_s`: images/s and the median ms per image."""
    seconds: list[float] = []
    ended = time.perf_counter() + duration_s
    while time.perf_counter() < ended or not seconds:
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return {"images_per_s": round(images_per_call * len(seconds) / sum(seconds), 1),
            "ms_per_image": round(statistics.median(seconds) * 1000 / images_per_call, 1)}


def measure(exports: Sequence[Path], settings: UltralyticsLabSettings) -> dict[str, Any]:
    jpegs = lab_jpegs()
    figures: dict[str, Any] = {}
    for export in exports:
        with tempfile.TemporaryDirectory(prefix="lab-ultralytics-") as tmp:
            work = Path(tmp)
            serving = served(export, jpegs, settings, work)
            reference = ultralytics_predict(export, jpegs, settings, work)
        best = max(reference.values(), key=lambda row: row["images_per_s"])
        figures[export.name] = {
            "served": serving, "ultralytics": reference,
            "served_at_most_clients_over_best_predict": round(
                serving[max(settings.clients)]["images_per_s"] / best["images_per_s"], 2),
            "one_client_p50_over_predict_one_image": round(
                serving[min(settings.clients)]["p50_ms"] / reference["one_at_a_time"]["ms_per_image"], 2)}
    return figures


def markdown(figures: dict[str, Any]) -> str:
    lines = []
    for name, row in figures.items():
        lines.append(f"{name}:")
        lines.append("| served, clients | images/s | p50 ms | errors |")
        lines.append("|---|---|---|---|")
        lines += [f"| {clients} | {load['images_per_s']} | {load['p50_ms']} | {load['errors']} |"
                  for clients, load in row["served"].items()]
        lines.append("| Ultralytics predict | images/s | ms per image |")
        lines.append("|---|---|---|")
        lines += [f"| {way.replace('_', ' ')} | {result['images_per_s']} | {result['ms_per_image']} |"
                  for way, result in row["ultralytics"].items()]
        lines.append(f"served at the most clients / Ultralytics' best: "
                     f"{row['served_at_most_clients_over_best_predict']}x; one client's p50 / "
                     f"Ultralytics' one image: {row['one_client_p50_over_predict_one_image']}x")
    return "\n".join(lines)
