"""When is the cache's near-duplicate mode safe? Perceptual-hash collisions on real photos and
their variants, and how often a collision would hand out a different answer than the model's.

    torchserve-vision lab near-duplicates --archive model_store/efficientnet_lite0-1.0.mar

Inputs: the 320 distinct JPEGs of `cascade_tradeoff.cascade_inputs` (ten photos, whole and as
random crops, flips, rescales and re-encodes), and four variants of each: JPEG re-encoded at
quality 70, rescaled to half size, shifted by 2 pixels (cropped off the top left), and cropped to
the central 90 %. In-process, with the archive's handler: each image's top-1 and perceptual hash.

- variant hit rate: the share of variants whose hash equals their original's (a cache hit);
  wrong among those: the share whose own top-1 differs from the original's (the answer a hit
  would give).
- distinct-input collisions: pairs of different inputs with equal hashes, and how many of those
  have different top-1 answers (a hit there hands one input another input's answer).
"""

from __future__ import annotations

import io
import json
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from handlers.cache.perceptual_hash import perceptual_hash
from handlers.ground.limits import ImageLimits
from handlers.request.decode import decode_image_bytes
from torchserve_vision.lab.cascade_tradeoff import cascade_inputs
from torchserve_vision.local_handler import archive_context, extract_archive, load_handler


def jpeg_of(image: Image.Image, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def opened(body: bytes) -> Image.Image:
    return Image.open(io.BytesIO(body)).convert("RGB")


VARIANTS: dict[str, Callable[[bytes], bytes]] = {
    "re-encoded q70": lambda body: jpeg_of(opened(body), 70),
    "half size": lambda body: jpeg_of(opened(body).resize(
        (max(1, opened(body).width // 2), max(1, opened(body).height // 2)), Image.Resampling.BICUBIC)),
    "shifted 2 px": lambda body: jpeg_of(opened(body).crop(
        (2, 2, opened(body).width, opened(body).height))),
    "central 90 %": lambda body: jpeg_of(central_crop(opened(body), 0.9)),
}


def central_crop(image: Image.Image, fraction: float) -> Image.Image:
    width, height = round(image.width * fraction), round(image.height * fraction)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return image.crop((left, top, left + width, top + height))


@dataclass(frozen=True)
class VariantRate:
    variant: str
    inputs: int
    hits: int            # hash equal to the original's
    wrong_hits: int      # ... with a top-1 differing from the original's


@dataclass(frozen=True)
class NearDuplicateReport:
    archive: str
    inputs: int
    variants: list[VariantRate]
    colliding_pairs: int           # distinct inputs with equal hashes
    colliding_pairs_wrong: int     # ... whose top-1 answers differ


def top1_answers(handler: Any, model_dir: Path, bodies: Sequence[bytes], batch: int = 8) -> list[int]:
    answers: list[int] = []
    for start in range(0, len(bodies), batch):
        chunk = bodies[start:start + batch]
        context = archive_context(model_dir, batch, [{} for _ in chunk])
        for body in handler.handle([{"body": bytearray(b)} for b in chunk], context):
            answers.append(int(json.loads(body)[0]["index"]))
    return answers


def hashes_of(bodies: Sequence[bytes]) -> list[bytes]:
    return [perceptual_hash(decode_image_bytes(body, ImageLimits(), torch.device("cpu")))
            for body in bodies]


def measure(archive: Path, count: int = 320) -> NearDuplicateReport:
    inputs = cascade_inputs(count)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = extract_archive(archive, Path(tmp) / "model")
        handler = load_handler(model_dir, 8)
        top1 = top1_answers(handler, model_dir, inputs)
        hashes = hashes_of(inputs)
        rates = []
        for name, make in VARIANTS.items():
            variants = [make(body) for body in inputs]
            variant_top1 = top1_answers(handler, model_dir, variants)
            hits = [h == v for h, v in zip(hashes, hashes_of(variants), strict=True)]
            wrong = sum(hit and a != b for hit, a, b in zip(hits, top1, variant_top1, strict=True))
            rates.append(VariantRate(name, len(inputs), sum(hits), wrong))
    groups: dict[bytes, list[int]] = defaultdict(list)
    for index, value in enumerate(hashes):
        groups[value].append(index)
    pairs = [(a, b) for members in groups.values() for i, a in enumerate(members) for b in members[i + 1:]]
    return NearDuplicateReport(archive.name, len(inputs), rates, len(pairs),
                               sum(top1[a] != top1[b] for a, b in pairs))


def markdown(report: NearDuplicateReport) -> str:
    lines = ["| variant of each input | hash equal (a hit) | of those, top-1 differs (wrong answer) |",
             "|---|---|---|"]
    for rate in report.variants:
        lines.append(f"| {rate.variant} | {rate.hits} of {rate.inputs} ({rate.hits / rate.inputs:.0%}) "
                     f"| {rate.wrong_hits} ({rate.wrong_hits / max(rate.hits, 1):.0%}) |")
    lines.append(f"\ndistinct inputs ({report.inputs}) with equal hashes: {report.colliding_pairs} "
                 f"pairs, {report.colliding_pairs_wrong} of them with different top-1 answers")
    return "\n".join(lines)


def as_json(report: NearDuplicateReport) -> str:
    return json.dumps(asdict(report), indent=2)
