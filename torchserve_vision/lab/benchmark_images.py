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
