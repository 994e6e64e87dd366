"""The default detector served, against what a user would run instead: one OpenCV `dnn` net on the
same frozen graph (TensorFlow's SSD MobileNetV2 COCO, from the same package), in this process,
from JPEG bytes to detections, in one run on one machine:

    torchserve-vision lab opencv --clients 1 4 16

Served: the archive (`model_store/ssd_mobilenet_v2-1.0.mar`) on a TorchServe of its own from the
development config (its engines as built; its workers and batch size config/models.yaml's, or
`--workers` / `--batch-size`), closed-loop clients at each
load sending the same JPEGs. OpenCV: `cv2.imdecode`, `cv2.dnn.blobFromImages` (300 x 300, RGB)
and `forward` (the graph's own postprocess: OpenCV's DetectionOutput), detections above 0.3 read
out; one image at a time and in batches, on every core (OpenCV's default). Printed: images/s and
p50 at each load, OpenCV's images/s and per-image latency each way, and the ratios (served at
each load over OpenCV's best rate; one client's p50 over OpenCV's latency for one image).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from torchserve_vision import paths
from torchserve_vision.lab.benchmark_images import jpeg_of
from torchserve_vision.lab.served_loads import served_loads
from torchserve_vision.model_descriptions import load_descriptions
from torchserve_vision.torchserve_config import server_config, write_models_block

MODEL = "ssd_mobilenet_v2"
TEXT_GRAPH = "ssd_mobilenet_v2_coco_2018_03_29.pbtxt"   # beside the frozen graph in the package
# The photos both sides get, at sizes a camera or an upload would give.
PHOTO_SIZES = {"coffee.png": (640, 491), "astronaut.png": (512, 512), "motorcycle_left.png": (741, 500),
               "rocket.jpg": (640, 427), "chelsea.png": (451, 300)}


@dataclass(frozen=True)
class OpenCvLabSettings:
    clients: tuple[int, ...] = (1, 4, 16)
    duration_s: float = 10.0
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    workers: int | None = None          # the served detector's, over config/models.yaml's
    batch_size: int | None = None


def lab_jpegs() -> list[bytes]:
    return [jpeg_of(name, size) for name, size in PHOTO_SIZES.items()]


def served(store: Path, jpegs: Sequence[bytes], settings: OpenCvLabSettings, work: Path) -> dict[int, Any]:
    """The store's default detector on a TorchServe of its own: images/s and p50 at each load."""
    config = server_config(work / "server", store, paths.DEVELOPMENT_CONFIG,
                           load_models=f"{MODEL}-1.0.mar")
    (described,) = [d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == MODEL]
    serving = replace(described.serving, batch_size=settings.batch_size or described.serving.batch_size,
                      min_workers=settings.workers or described.serving.min_workers,
                      max_workers=settings.workers or described.serving.max_workers)
    write_models_block(config, [replace(described, serving=serving)])
    return served_loads(config, store, MODEL, jpegs, settings.clients, settings.duration_s, work / "run")


def opencv_net() -> Any:
    import cv2

    from torchserve_vision.archives.tf_ssd_weights import packaged_graph

    graph = packaged_graph()
    return cv2.dnn.readNetFromTensorflow(str(graph), str(graph.parent / TEXT_GRAPH), cv2.dnn.ENGINE_CLASSIC)


def opencv_detect(net: Any, jpegs: Sequence[bytes]) -> list[np.ndarray]:
    """Each JPEG's detections above 0.3 (rows of image, class, score, box), as a user's OpenCV
    code gets them: decoded, batched into one blob, one forward pass."""
    import cv2

    images: list[Any] = [cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR) for data in jpegs]
    net.setInput(cv2.dnn.blobFromImages(images, 1.0, (300, 300), (0, 0, 0), swapRB=True, crop=False))
    rows = net.forward()[0, 0]
    return [rows[(rows[:, 0] == index) & (rows[:, 2] > 0.3)] for index in range(len(images))]


def opencv_rates(jpegs: Sequence[bytes], settings: OpenCvLabSettings) -> dict[str, dict[str, float]]:
    net = opencv_net()
    opencv_detect(net, jpegs[:1])                                                  # warm-up
    rates = {"one_at_a_time": timed(lambda: [opencv_detect(net, [data]) for data in jpegs], len(jpegs),
                                    settings.duration_s)}
    for batch in settings.batch_sizes:
        chosen = (list(jpegs) * batch)[:batch]
        opencv_detect(net, chosen)
        rates[f"batch_{batch}"] = timed(partial(opencv_detect, net, chosen), batch, settings.duration_s)
    return rates


def timed(call: Callable[[], Any], images_per_call: int, duration_s: float) -> dict[str, float]:
    seconds: list[float] = []
    ended = time.perf_counter() + duration_s
    while time.perf_counter() < ended or not seconds:
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return {"images_per_s": round(images_per_call * len(seconds) / sum(seconds), 1),
            "ms_per_image": round(statistics.median(seconds) * 1000 / images_per_call, 1)}


def measure(store: Path, settings: OpenCvLabSettings) -> dict[str, Any]:
    jpegs = lab_jpegs()
    with tempfile.TemporaryDirectory(prefix="lab-opencv-") as tmp:
        serving = served(store, jpegs, settings, Path(tmp))
    reference = opencv_rates(jpegs, settings)
    best = max(row["images_per_s"] for row in reference.values())
    return {"served": serving, "opencv": reference,
            "served_over_best_opencv": {clients: round(load["images_per_s"] / best, 2)
                                        for clients, load in serving.items()},
            "one_client_p50_over_opencv_one_image": round(
                serving[min(settings.clients)]["p50_ms"] / reference["one_at_a_time"]["ms_per_image"], 2)}


def markdown(figures: dict[str, Any]) -> str:
    lines = ["| served, clients | images/s | p50 ms | errors | over OpenCV's best |", "|---|---|---|---|---|"]
    lines += [f"| {clients} | {load['images_per_s']} | {load['p50_ms']} | {load['errors']} | "
              f"{figures['served_over_best_opencv'][clients]}x |"
              for clients, load in figures["served"].items()]
    lines += ["| OpenCV dnn, in-process | images/s | ms per image |", "|---|---|---|"]
    lines += [f"| {way.replace('_', ' ')} | {row['images_per_s']} | {row['ms_per_image']} |"
              for way, row in figures["opencv"].items()]
    lines.append(f"one client's p50 / OpenCV's one image: {figures['one_client_p50_over_opencv_one_image']}x")
    return "\n".join(lines)
