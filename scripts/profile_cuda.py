"""The handler path on a CUDA device, in-process, for a GPU machine without Java or TorchServe
(docs/benchmarks.md, "GPU"): per model and precision, ms per batch of the model alone and of the
whole handler path (JPEG bytes to JSON answers), batch 1 to 64; and per-image JPEG decode
(nvJPEG one at a time, nvJPEG batched, the CPU at full and at reduced scale).

    python scripts/profile_cuda.py          # from the repository root; writes $OUT/profile_cuda.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torchvision.io import decode_jpeg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from handlers.image_classifier import ImageClassifierHandler
from handlers.model.settings import ImageLimits
from handlers.request.decode import decode_image_bytes
from tests.archives import stage_model_dir
from torchserve_vision.lab.benchmark_images import benchmark_jpeg
from torchserve_vision.lab.profile import batch_sizes_up_to, batch_times, fit_batch_time, median_ms
from torchserve_vision.local_handler import archive_context
from torchserve_vision.model_descriptions import parse_description

MODELS = [("lite0", "efficientnet_lite0", "timm", "package:efficientnet_lite0"),
          ("resnet50", "resnet50", "torchvision", "fixed-seed:0")]
PRECISIONS = ("fp32", "fp16", "bf16")
MAX_BATCH = 64


def synchronize() -> None:
    torch.cuda.synchronize()


def description(name: str, architecture: str, source: str, weights: str, precision: str) -> Any:
    return parse_description({
        "name": name, "version": "1.0", "labels": "imagenet",
        "model": {"source": source, "architecture": architecture, "weights": weights},
        "handler": {"preprocess": {"resize_size": 256, "input_size": 224}, "top_k": 5,
                    "precision": precision, "channels_last": True}})


def profile(described: Any, image: bytes, repeats: int = 10) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = stage_model_dir(described, Path(tmp))
        handler = ImageClassifierHandler()
        handler.initialize(archive_context(model_dir, MAX_BATCH, gpu_id=0))
        sizes = batch_sizes_up_to(MAX_BATCH)
        model_ms, handler_ms = batch_times(handler, archive_context(model_dir, MAX_BATCH, gpu_id=0),
                                           sizes, image, repeats, synchronize)
        return {"sizes": sizes, "model_ms": model_ms, "handler_ms": handler_ms,
                "fit_model": str(fit_batch_time(sizes, model_ms)),
                "fit_handler": str(fit_batch_time(sizes, handler_ms)), "device": str(handler.device)}


def decode_times(image: bytes, repeats: int = 20) -> dict[str, float]:
    limits, cuda = ImageLimits(), torch.device("cuda:0")
    times = {
        "gpu_single_ms": median_ms(lambda: decode_image_bytes(image, limits, cuda), repeats, synchronize),
        "cpu_full_ms": median_ms(lambda: decode_image_bytes(image, limits, None), repeats, synchronize),
        "cpu_reduced_ms": median_ms(lambda: decode_image_bytes(image, limits, None, min_short_side=256),
                                    repeats, synchronize)}
    for count in (8, 32):
        data = [torch.frombuffer(bytearray(image), dtype=torch.uint8) for _ in range(count)]
        batched = median_ms(partial(decode_jpeg, data, device=cuda), repeats, synchronize)
        times[f"gpu_batched_{count}_per_image_ms"] = batched / count
    return times


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp")) / "profile_cuda.json"
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for kind in ("small", "phone"):
        results[f"decode_{kind}"] = decode_times(benchmark_jpeg(kind))
        print(kind, results[f"decode_{kind}"], flush=True)
    image = benchmark_jpeg("small")
    for name, architecture, source, weights in MODELS:
        for precision in PRECISIONS:
            started = time.time()
            try:
                results[f"{name}_{precision}"] = profile(
                    description(name, architecture, source, weights, precision), image)
            except (RuntimeError, TypeError, ValueError):   # one failing precision keeps the rest
                results[f"{name}_{precision}"] = traceback.format_exc()
            print(f"{name}_{precision}", f"{time.time() - started:.1f} s", flush=True)
            out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
