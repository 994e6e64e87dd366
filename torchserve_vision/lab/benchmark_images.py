"""The photos benchmarks send: real photos from scikit-image's wheel, re-encoded as JPEGs of the
sizes users send (nothing is downloaded)."""

from __future__ import annotations

import io

from PIL import Image

from torchserve_vision.photos import photo_path


def jpeg_of(name: str, size_wh: tuple[int, int], quality: int = 90) -> bytes:
    """scikit-image's photo `name` resized to `size_wh` and encoded as a baseline JPEG."""
    image = Image.open(photo_path(name)).convert("RGB").resize(size_wh, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


SIZES = {
    "small": ("astronaut.png", (720, 720)),      # ~0.5 MP, as in the reference measurements
    "phone": ("chelsea.png", (4000, 3000)),      # 12 MP, a phone camera photo
}


def benchmark_jpeg(kind: str = "small") -> bytes:
    name, size_wh = SIZES[kind]
    return jpeg_of(name, size_wh)


def distinct_jpegs(count: int, size: int = 720, quality: int = 90, seed: int = 0) -> list[bytes]:
    """`count` distinct `size` x `size` JPEGs (4:2:0 chroma, `quality`): seeded square crops (30 to
    100 % of the short side) of the project's photos in turn, mirrored or not, resized to the size;
    for load that must not repeat an image (a cache, or a decoder's buffers, would flatter it)."""
    import hashlib

    import numpy as np

    from torchserve_vision.photo_sets import project_photos

    photos = [photo.image for photo in project_photos()]
    rng = np.random.default_rng(seed)
    found: dict[bytes, bytes] = {}
    turn = 0
    while len(found) < count:
        photo = photos[turn % len(photos)]
        turn += 1
        side = int(min(photo.size) * rng.uniform(0.3, 1.0))
        left = int(rng.integers(0, photo.width - side + 1))
        top = int(rng.integers(0, photo.height - side + 1))
        image = photo.crop((left, top, left + side, top + side))
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        buffer = io.BytesIO()
        image.resize((size, size), Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=quality,
                                                                  subsampling="4:2:0")
        found.setdefault(hashlib.sha256(buffer.getvalue()).digest(), buffer.getvalue())
    return list(found.values())
