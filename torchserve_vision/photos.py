"""Real photos that ship inside the scikit-image wheel (nothing is downloaded): the rollouts'
default smoke-test image, the load generator's default body, the benchmarks' sources."""

from __future__ import annotations

from pathlib import Path

SMOKE_TEST_PHOTO = "chelsea.png"   # a cat: ImageNet classes 281-287 at the top


def photo_path(name: str = SMOKE_TEST_PHOTO) -> Path:
    import skimage

    return Path(skimage.__file__).parent / "data" / name
