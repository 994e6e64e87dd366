"""Real photos that ship inside the scikit-image wheel (nothing is downloaded): the rollouts'
default smoke-test image, the load generator's default body, the benchmarks' sources."""

from __future__ import annotations

from pathlib import Path

SMOKE_TEST_PHOTO = "chelsea.png"   # a cat: ImageNet classes 281-287 at the top


def photo_path(name: str = SMOKE_TEST_PHOTO) -> Path:
    import skimage

    return Path(skimage.__file__).parent / "data" / name


# Colour photos of things ImageNet has classes for: where a classifier's answers are meant to
# hold, and where reduced-precision bounds are measured (docs/precision.md). The first five are the
# load-time probe of compiled packages (built into archives) and the tests' photos.
PROBE_PHOTOS = ("chelsea.png", "coffee.png", "astronaut.png", "motorcycle_left.png", "rocket.jpg")
CLASSIFIER_PHOTOS = (*PROBE_PHOTOS, "motorcycle_right.png")


def all_photo_paths() -> list[Path]:
    """Every PNG / JPEG image in scikit-image's data folder (photos, micrographs, scans,
    grayscale and colour), sorted by name: a wide set for measuring numerical spread."""
    folder = photo_path().parent
    return sorted(path for path in folder.iterdir() if path.suffix in (".png", ".jpg"))
