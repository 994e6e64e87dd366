"""Plain in-process PyTorch on the lab's device, no project handler: what a served figure is
compared with on the same GPU in the same run (`lab gpu`).

- The classifier's model alone: eager at several batch sizes, in the archive's precision and
  memory format (images/s of the forward pass, inputs already on the device); as loaded (fp16
  and bf16 as autocast), with weights and input in the half dtype a CUDA worker runs, and that
  with its batch norms folded into its convolutions, as a CUDA worker runs it.
- The batched JPEG decode alone (handlers.request.jpeg_batches, torchvision's or nvImageCodec's
  decoder), its pixels on the device; the CPU-exact resize alone (720x720 -> 256x256, each way of
  handlers.task.fixed_point_resize).
- The classifier's pipeline: JPEG bytes -> top-5 on the host, one batch at a time: batched
  `decode_jpeg` on the device, resize (float, antialiased) to the resize size's square, centre
  crop, normalise, the network, softmax top-5, copied to the host. The steps of the team's
  reference script for this comparison, written here against the archive's own network.
- The detector's pipeline: batched decode, the images as floats, the torchvision detector (its
  own transform and postprocess), its boxes, scores and labels copied to the host; and its
  network alone (backbone and head on an input batch already on the device, at its input size).

Each figure is the best of a few timed repeats after a warm-up, with the device synchronised,
cycling through distinct images.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torchvision.io import decode_jpeg
from torchvision.transforms.v2.functional import center_crop

from handlers.model.cuda_batches import batch_norm_folded, half_weights_dtype
from handlers.model.model_loading import autocast
from handlers.request import chroma_kernels
from handlers.request.chroma_upsampling import H2V2, interpolated_chroma
from handlers.request.jpeg_batches import JpegDecoder, decode_jpeg_run
from handlers.task import resize_kernels
from handlers.task.fixed_point_resize import ResampleMethod, resize_exact
from handlers.task.transforms import channel_constants, normalize_batch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def images_per_s(step: Callable[[int], Any], batch: int, device: torch.device, repeats: int = 5,
                 warm_up: int = 2) -> float:
    """`batch` / the best time of `step(round)` over `repeats` rounds after `warm_up` rounds."""
    for round_index in range(warm_up):
        step(round_index)
    synchronize(device)
    best = float("inf")
    for round_index in range(warm_up, warm_up + repeats):
        started = time.perf_counter()
        step(round_index)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return batch / best


def model_only(network: nn.Module, input_size: int, precision: str, channels_last: bool,
               batches: Sequence[int], device: torch.device, half_weights: bool = False,
               fold_batch_norm: bool = False) -> dict[int, float]:
    """Images/s of the forward pass alone at each batch size; with `half_weights`, a copy of the
    network in the half dtype of `precision` on CUDA, fed in that dtype (as loaded elsewhere);
    with `fold_batch_norm`, its batch norms folded into its convolutions first on CUDA."""
    network = batch_norm_folded(network, device, fold_batch_norm)
    dtype = half_weights_dtype(device, precision, half_weights)
    if dtype is not None:
        network = copy.deepcopy(network).to(dtype)
    rates = {}
    with torch.inference_mode():
        for batch in batches:
            inputs = torch.randn(batch, 3, input_size, input_size, device=device,
                                 dtype=dtype or torch.float32)
            if channels_last:
                inputs = inputs.contiguous(memory_format=torch.channels_last)

            def forward(_round: int, inputs: torch.Tensor = inputs) -> Any:
                if dtype is not None:
                    return network(inputs)
                with autocast(device, precision):
                    return network(inputs)

            rates[batch] = images_per_s(forward, batch, device)
    return rates


def decode_only(jpegs: Sequence[bytes], batches: Sequence[int], device: torch.device,
                decoder: JpegDecoder) -> dict[int, float]:
    """Images/s of one batched decode call of `decoder`, the pixels on `device`."""
    rates = {}
    for batch in batches:
        def step(round_index: int, batch: int = batch) -> Any:
            start = (round_index * batch) % len(jpegs)
            return decode_jpeg_run([jpegs[(start + offset) % len(jpegs)] for offset in range(batch)],
                                   device, decoder)

        rates[batch] = images_per_s(step, batch, device)
    return rates


def parse_dmon(text: str) -> list[dict[str, int]]:
    """`nvidia-smi dmon -s u` output -> one {column: percent} per sample (the columns as its
    header names them: sm, mem, enc, dec, jpg, ofa; a "-" left out)."""
    columns: list[str] = []
    samples = []
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0] == "#":
            if not columns:
                columns = fields[1:]
            continue
        if columns and len(fields) == len(columns):
            samples.append({name: int(value) for name, value in zip(columns, fields, strict=True)
                            if value.lstrip("-").isdigit() and name != "gpu"})
    return samples


def decode_engine_use(jpegs: Sequence[bytes], batch: int, device: torch.device, decoder: JpegDecoder,
                      seconds: float = 4.0) -> dict[str, Any]:
    """Batched decode calls of `decoder` back to back for `seconds` while `nvidia-smi dmon -s u`
    samples the GPU once a second: the busiest sample of each engine (sm, dec, jpg: whether the
    decode runs on the JPEG engines) and the images decoded per second meanwhile."""
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return {"measured": False, "why": "needs a CUDA device and nvidia-smi"}
    monitor = subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-d", "1", "-i", str(device.index or 0)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    decoded = 0
    started = time.perf_counter()
    try:
        while time.perf_counter() - started < seconds:
            start = decoded % len(jpegs)
            chosen = [jpegs[(start + offset) % len(jpegs)] for offset in range(batch)]
            decode_jpeg_run(chosen, device, decoder)
            decoded += batch
        synchronize(device)
        elapsed = time.perf_counter() - started
    finally:
        monitor.terminate()
        output, _ = monitor.communicate(timeout=10)
    samples = parse_dmon(output)
    if not samples:
        return {"measured": False, "why": "nvidia-smi dmon printed no samples"}
    busiest = {name: max(sample.get(name, 0) for sample in samples) for name in ("sm", "dec", "jpg")}
    return {"measured": True, "samples": len(samples), "busiest_percent": busiest,
            "images_per_s": decoded / elapsed, "on_jpeg_engines": busiest.get("jpg", 0) > 0}


def resize_only(batches: Sequence[int], device: torch.device, method: ResampleMethod,
                side: int = 720, resized: int = 256) -> dict[int, float]:
    """Images/s of `resize_exact` (`method`) from `side` x `side` to `resized` x `resized`, uint8
    batches already on the device."""
    return on_random_batches(batches, device, side,
                             lambda images: resize_exact(images, (resized, resized), method))


def on_random_batches(batches: Sequence[int], device: torch.device, side: int,
                      work: Callable[[torch.Tensor], Any]) -> dict[int, float]:
    """Images/s of `work` on random uint8 `[batch, 3, side, side]` images already on the device,
    per batch size."""
    rates = {}
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        images = torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8,
                               generator=generator).to(device)

        def step(_round: int, images: torch.Tensor = images) -> Any:
            return work(images)

        rates[batch] = images_per_s(step, batch, device)
    return rates


def exact_preprocessing_only(batches: Sequence[int], device: torch.device, kernels: bool,
                             side: int = 720, resized: int = 256, crop: int = 224,
                             dtype: torch.dtype = torch.float16) -> dict[int, float]:
    """Images/s of a CUDA classifier's exact preprocessing after nvJPEG, uint8 `side` x `side`
    batches already on the device: 4:2:0 chroma interpolated, resized to `resized`, centre crop
    `crop`, normalised to `dtype`; by the Triton kernels (`kernels`) or the tensor operations."""
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    mean_t, std_t = (values.view(-1) for values in channel_constants(mean, std, device))

    def step(images: torch.Tensor) -> Any:
        if kernels:
            fixed = chroma_kernels.interpolated_chroma(images, H2V2)
            return resize_kernels.resized_crops_normalized(fixed, (resized, resized), crop,
                                                           mean_t, std_t, dtype)
        resized_images = resize_exact(interpolated_chroma(images, H2V2), (resized, resized))
        crops = center_crop(resized_images, [crop, crop])
        return normalize_batch(crops, mean, std, dtype)

    return on_random_batches(batches, device, side, step)


def detector_network_only(network: Any, precision: str, batches: Sequence[int],
                          device: torch.device) -> dict[int, float]:
    """Images/s of a torchvision SSD's backbone and head alone on an input batch at its fixed
    input size (no transform, no postprocess)."""
    height, width = getattr(network.transform, "fixed_size", None) or (320, 320)
    rates = {}
    with torch.inference_mode():
        for batch in batches:
            inputs = torch.randn(batch, 3, height, width, device=device)

            def forward(_round: int, inputs: torch.Tensor = inputs) -> Any:
                with autocast(device, precision):
                    features = network.backbone(inputs)
                    return network.head(list(features.values()))

            rates[batch] = images_per_s(forward, batch, device)
    return rates


def batch_of(jpegs: Sequence[bytes], batch: int, round_index: int) -> list[torch.Tensor]:
    start = (round_index * batch) % len(jpegs)
    chosen = [jpegs[(start + offset) % len(jpegs)] for offset in range(batch)]
    return [torch.frombuffer(bytearray(body), dtype=torch.uint8) for body in chosen]


def classifier_pipeline(network: nn.Module, jpegs: Sequence[bytes], resize_size: int, input_size: int,
                        mean: Sequence[float], std: Sequence[float], precision: str,
                        channels_last: bool, batches: Sequence[int],
                        device: torch.device) -> dict[int, float]:
    """Images/s from JPEG bytes to top-5 on the host, at each batch size (equal-sized JPEGs)."""
    mean_t = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
    std_t = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255
    top = (resize_size - input_size) // 2
    rates = {}
    for batch in batches:
        def step(round_index: int, batch: int = batch) -> Any:
            images = decode_jpeg(batch_of(jpegs, batch, round_index), device=device)
            pixels = F.interpolate(torch.stack(images).float(), size=(resize_size, resize_size),
                                   mode="bilinear", antialias=True, align_corners=False)
            pixels = ((pixels[:, :, top:top + input_size, top:top + input_size] - mean_t) / std_t)
            if channels_last:
                pixels = pixels.contiguous(memory_format=torch.channels_last)
            with torch.inference_mode(), autocast(device, precision):
                best = network(pixels).float().softmax(1).topk(5)
            return best.values.cpu(), best.indices.cpu()

        rates[batch] = images_per_s(step, batch, device)
    return rates


def detector_pipeline(network: nn.Module, jpegs: Sequence[bytes], precision: str,
                      batches: Sequence[int], device: torch.device) -> dict[int, float]:
    """Images/s from JPEG bytes to each image's boxes, scores and labels on the host."""
    rates = {}
    for batch in batches:
        def step(round_index: int, batch: int = batch) -> Any:
            images = decode_jpeg(batch_of(jpegs, batch, round_index), device=device)
            with torch.inference_mode(), autocast(device, precision):
                found = network([image.float() / 255 for image in images])
            return [{key: value.cpu() for key, value in detections.items()} for detections in found]

        rates[batch] = images_per_s(step, batch, device)
    return rates
