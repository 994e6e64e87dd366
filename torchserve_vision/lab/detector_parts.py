"""Where a torchvision SSD-family detector's time goes, in one process on this CPU: its transform,
backbone, head and postprocess (box decoding, score filter, per-class NMS) at the archive's
served settings, the postprocess and the whole model again as a batch of requests at the
default score threshold runs them (candidates under every request's threshold dropped first:
handlers.model.detector_formats.candidates_from), and the backbone + head converted to OpenVINO
(f32, bf16 where native), to say what an engine would save before building one.

    torchserve-vision lab detector-parts                  # model_store/ssdlite320-1.0.mar
    torchserve-vision lab detector-parts --threads 2 --batch-sizes 1 4

ms per call, best of `rounds` x `repeats`, on scikit-image's photos.
"""

from __future__ import annotations

import functools
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from handlers.model.detector_formats import candidates_from
from handlers.model.engine_runners import openvino_core
from handlers.model.settings import SettingsError
from handlers.object_detector import ObjectDetectorHandler
from torchserve_vision.lab.local_handler import archive_context, extract_archive
from torchserve_vision.photos import PROBE_PHOTOS, photo_path

PARTS = ("transform", "backbone", "head", "postprocess", "whole")


class BackboneAndHead(nn.Module):
    """An SSD's backbone and head: `float[B, 3, S, S]` -> (box regression, class logits)."""

    def __init__(self, detector: Any) -> None:
        super().__init__()
        self.backbone, self.head = detector.backbone, detector.head

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = self.head(list(self.backbone(images).values()))
        return output["bbox_regression"], output["cls_logits"]


def best_ms(call: Callable[[], Any], repeats: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - started) / repeats * 1000)
    return best


def photos(count: int) -> list[torch.Tensor]:
    """`count` of scikit-image's photos as float [3, H, W] in [0, 1], in turn."""
    from handlers.request.decode import ImageLimits, decode_image_bytes

    images = [decode_image_bytes(photo_path(name).read_bytes(), ImageLimits()).float() / 255
              for name in PROBE_PHOTOS]
    return [images[index % len(images)] for index in range(count)]


def openvino_forward(module: nn.Module, example: torch.Tensor, precision: str, threads: int) -> Any:
    import openvino

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = openvino.convert_model(module, example_input=example,
                                           input=[(-1, *example.shape[1:])])
    compiled = openvino_core().compile_model(converted, "CPU", {
        "INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False})
    return compiled.create_infer_request()


def measure_batch(detector: Any, batch_size: int, threads: int, bf16: bool, repeats: int,
                  rounds: int, default_threshold: float) -> dict[str, float]:
    batch = photos(batch_size)
    with torch.inference_mode():
        images, _ = detector.transform(batch)
        features = list(detector.backbone(images.tensors).values())
        head = detector.head(features)
        anchors = detector.anchor_generator(images, features)
        figures = {
            "transform": best_ms(lambda: detector.transform(batch), repeats, rounds),
            "backbone": best_ms(lambda: detector.backbone(images.tensors), repeats, rounds),
            "head": best_ms(lambda: detector.head(features), repeats, rounds),
            "postprocess": best_ms(lambda: detector.postprocess_detections(
                head, anchors, images.image_sizes), repeats, rounds),
            "whole": best_ms(lambda: detector(batch), repeats, rounds),
        }
        with candidates_from(detector, default_threshold):
            figures[f"postprocess, requests at {default_threshold}"] = best_ms(
                lambda: detector.postprocess_detections(head, anchors, images.image_sizes),
                repeats, rounds)
            figures[f"whole, requests at {default_threshold}"] = best_ms(
                lambda: detector(batch), repeats, rounds)
    network_input = images.tensors.numpy().copy()
    for precision in ("f32", "bf16") if bf16 else ("f32",):
        request = openvino_forward(BackboneAndHead(detector).eval(), images.tensors, precision, threads)
        figures[f"openvino {precision} backbone+head"] = best_ms(
            functools.partial(request.infer, {0: network_input}), repeats, rounds)
    return figures


def measure(archive: Path, threads: int, batch_sizes: Sequence[int], repeats: int, rounds: int
            ) -> dict[int, dict[str, float]]:
    """batch size -> part -> best ms, for the archive's detector as its worker loads it;
    ValueError for an archive that holds no torchvision SSD-family detector."""
    from handlers.model.model_loading import cpu_has_native_bf16

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        handler = ObjectDetectorHandler()
        try:
            handler.initialize(archive_context(extract_archive(archive, Path(tmp))))
        except SettingsError as error:
            raise ValueError(f"{archive.name}: not a detector archive ({error})") from None
        detector = handler.network
        if not all(hasattr(detector, part) for part in ("transform", "backbone", "head",
                                                        "postprocess_detections")):
            raise ValueError(f"{archive.name}: not a torchvision SSD-family detector")
        default_threshold = handler.settings.defaults.score_threshold
        return {batch_size: measure_batch(detector, batch_size, threads, cpu_has_native_bf16(),
                                          repeats, rounds, default_threshold)
                for batch_size in batch_sizes}


def table(figures: dict[int, dict[str, float]]) -> str:
    sizes = list(figures)
    parts = list(next(iter(figures.values())))
    lines = [f"{'part':<34} " + " ".join(f"{f'batch {b} ms':>12}" for b in sizes)]
    for part in parts:
        lines.append(f"{part:<34} " + " ".join(f"{figures[b][part]:>12.2f}" for b in sizes))
    return "\n".join(lines)
