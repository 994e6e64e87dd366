"""The same classifier archive on a GPU and on the machine's own CPU: do its answers agree by the
project's rule (handlers.model.answer_agreement.cross_device_bound)?

The images: the project's photos as JPEG (quality 90) and seeded variants of them (crops,
mirrors, rescales, JPEG qualities 50-95; `photo_sets.variant_jpegs`), and each photo stored
turned with every EXIF orientation other than 1 (so displayed upright: a GPU worker that ignored
orientation would answer them as turned photos). The reference is the archive at fp32 on the
CPU; the candidates are the archive on the GPU at each precision asked. Used by `lab gpu` and
by the GPU tests (tests/gpu/).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from handlers.ground.errors import ClientError
from handlers.model.answer_agreement import RankedClasses, answer_disagreement, cross_device_bound
from handlers.request.decode import DecodeResult, decode_with_headers
from handlers.request.image_header import ImageHeader
from torchserve_vision.local_handler import archive_context, load_handler
from torchserve_vision.photo_sets import jpeg, project_photos, variant_jpegs

# Pillow's transposition that stores a photo so that EXIF orientation N shows it upright (the
# inverse of what exif_transpose applies for N).
STORED_TURNED = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                 4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
                 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
                 8: Image.Transpose.ROTATE_270}
DEFAULT_VARIANTS = 64


@dataclass(frozen=True)
class NamedImage:
    name: str
    body: bytes


@dataclass
class DeviceAgreement:
    """One precision on the GPU against fp32 on the CPU, over `images` images."""

    precision: str
    bound: float
    images: int
    decoded_on: str = "device"        # "cpu": the GPU's answers with the CPU's decoded pixels
    max_change: float = 0.0
    worst_image: str = ""
    top1_changes: int = 0
    disagreements: dict[str, str] = field(default_factory=dict)   # image -> why

    @property
    def agrees(self) -> bool:
        return not self.disagreements

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "agrees": self.agrees}


def turned_jpeg(image: Image.Image, orientation: int) -> bytes:
    """`image` stored turned, with the EXIF orientation that shows it upright (quality 90)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.transpose(STORED_TURNED[orientation]).save(buffer, "JPEG", quality=90, exif=exif.tobytes())
    return buffer.getvalue()


def answer_check_images(variants: int = DEFAULT_VARIANTS, seed: int = 0) -> list[NamedImage]:
    """The photos and `variants` - 6 variants (`photo_sets.variant_jpegs`), then every photo
    turned with orientations 2..8."""
    photos = project_photos()
    images = [NamedImage(f"variant-{index:02d}", body)
              for index, body in enumerate(variant_jpegs(photos, variants, seed))]
    images[:len(photos)] = [NamedImage(photo.name, jpeg(photo.image, 90)) for photo in photos]
    for photo in photos:
        images += [NamedImage(f"{photo.name}@orientation-{orientation}",
                              turned_jpeg(photo.image, orientation)) for orientation in STORED_TURNED]
    return images


def ranked_answers(handler: Any, images: Sequence[NamedImage]) -> list[RankedClasses]:
    """The handler's top-k for each image, sent in batches of its batch size; every one a 200."""
    answers: list[RankedClasses] = []
    size = handler.max_batch_size
    for start in range(0, len(images), size):
        chunk = images[start:start + size]
        context = archive_context(handler.model_dir, size, request_headers=[{} for _ in chunk])
        bodies = handler.handle([{"body": bytearray(image.body)} for image in chunk], context)
        for index, (image, body) in enumerate(zip(chunk, bodies, strict=True)):
            if context.status(index) != 200:
                raise AssertionError(f"{image.name}: status {context.status(index)}: {body[:300]!r}")
            answers.append([(entry["index"], entry["probability"]) for entry in json.loads(body)])
    return answers


def agreement(precision: str, names: Sequence[str], got: Sequence[RankedClasses],
              reference: Sequence[RankedClasses], decoded_on: str = "device") -> DeviceAgreement:
    """How far `got` (the GPU at `precision`) is from `reference` (the CPU at fp32), image by
    image, and where the rule refuses it. `decoded_on`: "device" (the archive's decoder on the
    GPU), "nvimgcodec" (nvImageCodec's there) or "cpu" (the CPU's decoded pixels)."""
    bound = cross_device_bound(precision, device_decoder=decoded_on != "cpu")
    result = DeviceAgreement(precision, bound, len(names), decoded_on)
    for name, answer, expected in zip(names, got, reference, strict=True):
        expected_p = dict(expected)
        change = max((abs(p - expected_p[index]) for index, p in answer if index in expected_p),
                     default=0.0)
        if change > result.max_change:
            result.max_change, result.worst_image = change, name
        result.top1_changes += answer[0][0] != expected[0][0]
        reason = answer_disagreement(answer, expected, bound)
        if reason is not None:
            result.disagreements[name] = reason
    return result


def decoding_on_the_cpu(handler: Any) -> Any:
    """`handler` with its batches decoded on the CPU and then moved to its device: its answers
    without the device's decoder, so that the decoder's share of a difference can be told apart
    from the arithmetic's (a measurement; served handlers decode on their device)."""
    def decode_images(encoded: Sequence[bytes]) -> list[tuple[DecodeResult, ImageHeader | None]]:
        return [(result if isinstance(result, ClientError) else result.to(handler.device), header)
                for result, header in decode_with_headers(encoded, handler.settings.limits,
                                                          torch.device("cpu"), handler.jpeg_draft_size)]

    handler.decode_images = decode_images
    return handler


def compare_devices(model_dir: Path, gpu_id: int | None, precisions: Sequence[str],
                    images: Sequence[NamedImage], batch_size: int = 16,
                    decode_share: bool = False, nvimgcodec: bool = False) -> list[DeviceAgreement]:
    """The extracted classifier archive in `model_dir` at fp32 on the CPU against itself on
    `gpu_id` (None: the CPU again, to rehearse) at each of `precisions`; with `decode_share`,
    also at fp32 with the CPU's decoded pixels (what the device's decoder adds is the difference);
    with `nvimgcodec`, also at fp32 decoded by nvImageCodec (`jpeg_decoder: nvimgcodec`)."""
    reference_handler = load_handler(model_dir, batch_size, None, {"precision": "fp32"})
    reference = ranked_answers(reference_handler, images)
    names = [image.name for image in images]
    results = []
    for precision in precisions:
        handler = load_handler(model_dir, batch_size, gpu_id, {"precision": precision})
        results.append(agreement(precision, names, ranked_answers(handler, images), reference))
    if decode_share:
        handler = decoding_on_the_cpu(load_handler(model_dir, batch_size, gpu_id, {"precision": "fp32"}))
        results.append(agreement("fp32", names, ranked_answers(handler, images), reference, "cpu"))
    if nvimgcodec:
        handler = load_handler(model_dir, batch_size, gpu_id,
                               {"precision": "fp32", "jpeg_decoder": "nvimgcodec"})
        results.append(agreement("fp32", names, ranked_answers(handler, images), reference, "nvimgcodec"))
    return results
