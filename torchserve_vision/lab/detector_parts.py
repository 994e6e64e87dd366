"""Where a torchvision SSD-family detector's time goes, in one process on this CPU: its transform,
backbone, head and postprocess (box decoding, score filter, per-class NMS) at the archive's
served settings, and beside the transform and the postprocess the batch-at-once versions a GPU
worker runs (handlers.model.ssd_engine.ssd_input_batch, handlers.task.ssd_postprocess); the
postprocess and the whole model again as a batch of requests at the default score threshold
runs them (candidates under every request's threshold dropped first:
handlers.model.detector_formats.candidates_from), the whole model as the worker serves it (its
backbone and head on the runner it chose: handlers.model.ssd_engine), and the backbone + head on
each engine the archive has a model for (OpenVINO f32, bf16 where native; ONNX Runtime), or
converted to OpenVINO here for an archive without any.

    torchserve-vision lab detector-parts                  # model_store/ssd_mobilenet_v2-1.0.mar
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
from handlers.model.engine_runners import (
    OPENVINO_PRECISION_HINTS,
    OnnxRuntimeRunner,
    OpenVinoRunner,
    openvino_core,
)
from handlers.model.openvino_package import openvino_package
from handlers.model.runner_selection import EngineModel
from handlers.model.ssd_engine import NotAnSsdDetector, SsdBackboneHead, ssd_input_batch, ssd_input_size_hw
from handlers.object_detector import ObjectDetectorHandler
from handlers.task.detection import candidate_score_threshold
from handlers.task.ssd_postprocess import RequestSelection, SsdPostprocessSettings, batched_ssd_detections
from torchserve_vision.local_handler import archive_context, extract_archive
from torchserve_vision.model_kinds import kind_of_entry_module
from torchserve_vision.photos import PROBE_PHOTOS, photo_path

PARTS = ("transform", "backbone", "head", "postprocess", "whole")


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


Forward = Callable[[torch.Tensor], Any]


def openvino_forward(module: nn.Module, example: torch.Tensor, precision: str, threads: int) -> Forward:
    openvino = openvino_package()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = openvino.convert_model(module, example_input=example,
                                           input=[(-1, *example.shape[1:])])
    compiled = openvino_core().compile_model(converted, "CPU", {
        "INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False})
    request = compiled.create_infer_request()
    return lambda batch: request.infer({0: batch.numpy()})


def engine_forwards(detector: Any, model_dir: Path, engine_models: Sequence[EngineModel],
                    example: torch.Tensor, threads: int, bf16: bool) -> dict[str, Forward]:
    """Runner name -> the backbone + head on it: the archive's engine models, or, where it has
    none, the backbone + head converted to OpenVINO here."""
    precisions = ("fp32", "bf16") if bf16 else ("fp32",)
    if not engine_models:
        module = SsdBackboneHead(detector).eval()
        return {f"openvino-{precision}": openvino_forward(
            module, example, OPENVINO_PRECISION_HINTS[precision], threads) for precision in precisions}
    forwards: dict[str, Forward] = {}
    for model in engine_models:
        path = model_dir / model.file
        if model.engine == "onnxruntime":
            forwards["onnxruntime-fp32"] = OnnxRuntimeRunner(path, threads).outputs
        else:
            for precision in precisions:
                forwards[f"openvino-{precision}"] = OpenVinoRunner(path, precision, threads, None).outputs
    return forwards


def measure_batch(handler: ObjectDetectorHandler, batch_size: int, threads: int, bf16: bool,
                  repeats: int, rounds: int) -> dict[str, float]:
    detector: Any = handler.network
    threshold = handler.settings.defaults.score_threshold
    batch = photos(batch_size)
    with torch.inference_mode():
        images, _ = detector.transform(batch)
        features = list(detector.backbone(images.tensors).values())
        head = detector.head(features)
        anchors = detector.anchor_generator(images, features)
        uint8_batch = [(image * 255).round().to(torch.uint8) for image in batch]
        figures = {
            "transform": best_ms(lambda: detector.transform(batch), repeats, rounds),
            "transform, batched": best_ms(lambda: ssd_input_batch(detector, uint8_batch, torch.device("cpu")),
                                          repeats, rounds),
            "backbone": best_ms(lambda: detector.backbone(images.tensors), repeats, rounds),
            "head": best_ms(lambda: detector.head(features), repeats, rounds),
            "postprocess": best_ms(lambda: detector.postprocess_detections(
                head, anchors, images.image_sizes), repeats, rounds),
            "postprocess, batched": best_ms(batched_postprocess(detector, head, anchors[0], batch, None),
                                            repeats, rounds),
            "whole": best_ms(lambda: detector(batch), repeats, rounds),
        }
        figures[f"postprocess, batched, requests at {threshold}"] = best_ms(
            batched_postprocess(detector, head, anchors[0], batch, threshold), repeats, rounds)
        with candidates_from(detector, threshold):
            figures[f"postprocess, requests at {threshold}"] = best_ms(
                lambda: detector.postprocess_detections(head, anchors, images.image_sizes),
                repeats, rounds)
            figures[f"whole, requests at {threshold}"] = best_ms(lambda: detector(batch), repeats, rounds)
            figures[f"whole as served ({handler.runner}), requests at {threshold}"] = best_ms(
                lambda: handler.detector.run(batch), repeats, rounds)
        forwards = engine_forwards(detector, handler.model_dir, handler.settings.engine_models,
                                   images.tensors, threads, bf16)
        for runner, forward in forwards.items():
            figures[f"{runner} backbone+head"] = best_ms(functools.partial(forward, images.tensors),
                                                         repeats, rounds)
    return figures


def batched_postprocess(detector: Any, head: dict[str, torch.Tensor], anchors_xyxy: torch.Tensor,
                        batch: Sequence[torch.Tensor], threshold: float | None) -> Callable[[], Any]:
    """handlers.task.ssd_postprocess's postprocess and selection for the batch, every request at
    `threshold` (None: the network's own threshold), as a call."""
    lowest = candidate_score_threshold(float(detector.score_thresh), threshold)
    selection = RequestSelection(threshold or 0.0, None, int(detector.detections_per_img))
    sizes = [(int(image.shape[-2]), int(image.shape[-1])) for image in batch]
    return lambda: batched_ssd_detections(
        head["bbox_regression"], head["cls_logits"], anchors_xyxy, ssd_input_size_hw(detector), sizes,
        SsdPostprocessSettings.of(detector), lowest, [selection] * len(batch))


def measure(archive: Path, threads: int, batch_sizes: Sequence[int], repeats: int, rounds: int
            ) -> dict[int, dict[str, float]]:
    """batch size -> part -> best ms, for the archive's detector as its worker loads it;
    ValueError for an archive that holds no torchvision SSD-family detector."""
    from handlers.model.model_loading import cpu_has_native_bf16

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        context = archive_context(extract_archive(archive, Path(tmp)))
        handler_file = context.manifest["model"]["handler"]
        if kind_of_entry_module(handler_file).network != "detector":
            raise ValueError(f"{archive.name}: not a detector archive (its handler is {handler_file})")
        handler = ObjectDetectorHandler()
        handler.initialize(context)
        try:
            ssd_input_size_hw(handler.network)
        except NotAnSsdDetector as error:
            raise ValueError(f"{archive.name}: {error}") from None
        torch.set_num_threads(threads)    # a worker whose engine computes keeps torch at 1
        return {batch_size: measure_batch(handler, batch_size, threads, cpu_has_native_bf16(),
                                          repeats, rounds)
                for batch_size in batch_sizes}


def table(figures: dict[int, dict[str, float]]) -> str:
    sizes = list(figures)
    parts = list(next(iter(figures.values())))
    lines = [f"{'part':<52} " + " ".join(f"{f'batch {b} ms':>12}" for b in sizes)]
    for part in parts:
        lines.append(f"{part:<52} " + " ".join(f"{figures[b][part]:>12.2f}" for b in sizes))
    return "\n".join(lines)
