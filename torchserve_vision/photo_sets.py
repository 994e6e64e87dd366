"""Sets of real photos for calibrating and checking a model at build time and in the lab: the
project's photos (scikit-image's photos of things ImageNet has classes for) or a folder the user
names (`--images DIR`), each photo tagged with its *source*, so that a split never puts variants
of one scene on both sides (calibration and gate).

A photo set is grown to the size a measurement needs with seeded variants of each photo (random
crops, mirroring, rescaling, JPEG qualities): the variants of one photo share its source.
Nothing is downloaded; PIL only (no torch).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from torchserve_vision.photos import photo_path

# The project's photos of ImageNet subjects, by source: the two motorcycle photos are one stereo
# pair of the same scene, so they are one source.
PROJECT_PHOTO_SOURCES = {"astronaut.png": "astronaut", "chelsea.png": "chelsea", "coffee.png": "coffee",
                         "motorcycle_left.png": "motorcycle", "motorcycle_right.png": "motorcycle",
                         "rocket.jpg": "rocket"}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


class PhotoSetError(ValueError):
    """A folder that gives no usable photo set (missing, empty, unreadable, one source only)."""


@dataclass(frozen=True)
class Photo:
    name: str            # the file's name
    source: str          # photos of one scene share it (a folder's photos: the file's stem)
    image: Image.Image   # RGB


def project_photos() -> list[Photo]:
    return [Photo(name, source, Image.open(photo_path(name)).convert("RGB"))
            for name, source in PROJECT_PHOTO_SOURCES.items()]


def folder_photos(directory: Path) -> list[Photo]:
    """Every image file directly in `directory` (sorted by name), each its own source; PhotoSetError
    naming the folder or the file that cannot be read."""
    if not directory.is_dir():
        raise PhotoSetError(f"{directory} is not a folder of photos")
    files = sorted(path for path in directory.iterdir() if path.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise PhotoSetError(f"{directory} holds no photos ({', '.join(IMAGE_SUFFIXES)})")
    photos = []
    for path in files:
        try:
            image = Image.open(path).convert("RGB")
        except (OSError, UnidentifiedImageError) as error:
            raise PhotoSetError(f"{path} cannot be read as an image: {error}") from None
        photos.append(Photo(path.name, path.stem, image))
    return photos


def load_photos(directory: Path | None) -> list[Photo]:
    """The photos of `directory`, or the project's when None."""
    return project_photos() if directory is None else folder_photos(directory)


def split_by_source(photos: Sequence[Photo], held_out_share: float) -> tuple[list[Photo], list[Photo]]:
    """(kept, held out): whole sources on each side, about `held_out_share` of the sources held
    out (at least one each side), chosen by a hash of the source's name: the same photos always
    split the same way, whatever their order. PhotoSetError with fewer than two sources."""
    sources = sorted({photo.source for photo in photos},
                     key=lambda source: hashlib.sha256(source.encode()).hexdigest())
    if len(sources) < 2:
        raise PhotoSetError(f"splitting by source needs photos of at least two scenes; "
                            f"got {len(sources)} ({sources})")
    held_count = min(len(sources) - 1, max(1, round(held_out_share * len(sources))))
    held = set(sources[:held_count])
    return ([photo for photo in photos if photo.source not in held],
            [photo for photo in photos if photo.source in held])


def variant(photo: Image.Image, rng: np.random.Generator, min_area: float = 0.3) -> tuple[Image.Image, int]:
    """A random crop (`min_area`-100 % of the area, aspect 3:4..4:3), maybe mirrored, rescaled to
    a short side of 180-720 px; and a JPEG quality of 50-95."""
    width, height = photo.size
    area = rng.uniform(min_area, 1.0) * width * height
    aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    crop_w = int(min(width, round((area * aspect) ** 0.5)))
    crop_h = int(min(height, round((area / aspect) ** 0.5)))
    left = int(rng.integers(0, width - crop_w + 1))
    top = int(rng.integers(0, height - crop_h + 1))
    image = photo.crop((left, top, left + crop_w, top + crop_h))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    short = int(rng.integers(180, 721))
    scale = short / min(image.size)
    image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                         Image.Resampling.BICUBIC)
    return image, int(rng.integers(50, 96))


def jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def variant_jpegs(photos: Sequence[Photo], count: int, seed: int, min_area: float = 0.3) -> list[bytes]:
    """`count` distinct JPEGs: each photo whole (quality 90), then seeded variants of the photos
    in turn until there are `count` (fewer photos than `count` whole: the first `count`)."""
    rng = np.random.default_rng(seed)
    inputs = {hashlib.sha256(body).digest(): body for body in (jpeg(p.image, 90) for p in photos)}
    turn = 0
    while len(inputs) < count:
        body = jpeg(*variant(photos[turn % len(photos)].image, rng, min_area))
        inputs.setdefault(hashlib.sha256(body).digest(), body)
        turn += 1
    return list(inputs.values())[:count]
