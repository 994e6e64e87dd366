"""Profile a model archive in-process: time per batch t(B) for B = 1, 2, 4, ... up to the maximum,
for the model alone and for the whole handler path from JPEG bytes to JSON answers, on the
worker's device (CUDA synchronised when on a GPU), and fit t(B) = t_fixed + B * t_img.

    torchserve-vision lab profile model_store/efficientnet_lite0-1.0.mar --max-batch 8
    torchserve-vision lab profile model_store/efficientnet_lite0-1.0.mar --device cuda --json
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from handlers.serving import BatchedImageHandler
from torchserve_vision.errors import LabError
from torchserve_vision.lab.batch_model import BatchTimeFit, fit_batch_time
from torchserve_vision.local_handler import LocalContext, archive_context, extract_archive, load_handler


@dataclass(frozen=True)
class Profile:
    archive: str
    device: str
    image: str
    batch_sizes: list[int]
    model_ms: list[float]
    handler_ms: list[float]
    model_fit: BatchTimeFit
    handler_fit: BatchTimeFit

    def throughput_rps(self, which: str, batch_size: int) -> float:
        times = self.model_ms if which == "model" else self.handler_ms
        return batch_size * 1000.0 / times[self.batch_sizes.index(batch_size)]

    def table(self) -> str:
        rows = [f"{self.archive} on {self.device}, image {self.image}",
                "   B   model ms  img/s   handler ms  img/s"]
        for index, size in enumerate(self.batch_sizes):
            rows.append(f"{size:4d} {self.model_ms[index]:9.1f} {self.throughput_rps('model', size):6.1f}"
                        f" {self.handler_ms[index]:11.1f} {self.throughput_rps('handler', size):6.1f}")
        for name, fit in (("model", self.model_fit), ("handler", self.handler_fit)):
            rows.append(f"fit {name:7s}: t(B) = {fit.t_fixed_ms:.2f} + B x {fit.t_img_ms:.2f} ms "
                        f"(rms error {fit.rms_error_ms:.2f} ms, R^2 {fit.r_squared:.3f})")
        return "\n".join(rows)


def batch_sizes_up_to(maximum: int) -> list[int]:
    sizes, size = [], 1
    while size < maximum:
        sizes.append(size)
        size *= 2
    return [*sizes, maximum]


def median_ms(run: Callable[[], Any], repeats: int, synchronize: Callable[[], None]) -> float:
    for _ in range(2):
        run()
    synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def batch_times(handler: BatchedImageHandler[Any, Any, Any, Any], context: LocalContext,
                sizes: list[int], image: bytes, repeats: int,
                synchronize: Callable[[], None]) -> tuple[list[float], list[float]]:
    """Median ms per batch of each size in `sizes`: the model alone (one decoded, preprocessed
    image repeated), and the whole handler path (`handle`, encoded bytes to answers)."""
    model_ms, handler_ms = [], []
    for size in sizes:
        parsed = handler.parse_request({"body": bytearray(image)}, lambda _name: None)
        item = handler.decode(parsed.images[0], parsed.options)
        with torch.inference_mode():
            model_input = handler.preprocess([item] * size)
            model_ms.append(median_ms(partial(handler.infer, model_input), repeats, synchronize))
        rows = [{"body": bytearray(image)} for _ in range(size)]
        handler_ms.append(median_ms(partial(handler.handle, rows, context), repeats, synchronize))
    return model_ms, handler_ms


def profile_archive(mar: Path, max_batch: int, repeats: int, image: bytes, image_name: str,
                    device: str = "cpu") -> Profile:
    if device == "cuda" and not torch.cuda.is_available():
        raise LabError("--device cuda: no CUDA device here")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = extract_archive(mar, Path(tmp) / "model")
        handler = load_handler(model_dir, max_batch, gpu_id=0 if device == "cuda" else None)
        def synchronize() -> None:
            if handler.device.type == "cuda":
                torch.cuda.synchronize(handler.device)
        sizes = batch_sizes_up_to(max_batch)
        model_ms, handler_ms = batch_times(handler, archive_context(model_dir, max_batch), sizes,
                                           image, repeats, synchronize)
    return Profile(mar.name, str(handler.device), image_name, sizes, model_ms, handler_ms,
                   fit_batch_time(sizes, model_ms), fit_batch_time(sizes, handler_ms))
