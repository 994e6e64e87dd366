"""Buckets of what a request brings and what the model answers, for drift monitoring.

Every observation is a `(feature, bucket)` pair of short strings. The buckets of each feature
are fixed here, whatever the traffic, each named by its lower edge, so that a Prometheus series
per bucket keeps the label cardinality bounded (`len(BUCKETS[feature])` series per feature,
model and version):

- inputs (every image): `format` (the header's), `width` and `height` (stored pixels, powers of
  two), `aspect` (width / height), `brightness` (mean luma of a 32x32-ish subsample, 0-255);
- classification (every answer): `class` (the top-1 class's index, in 16 equal ranges of the
  class list: ImageNet's ids follow WordNet, so a range is a family such as dogs or vehicles)
  and `confidence` (the top-1 probability, tenths);
- detection (every box of an answer): `class` and `confidence` (its score); and per image
  `boxes` (how many).

Pure code: no TorchServe.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

CLASS_RANGES = 16
FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
SIDE_EDGES_PX = (256, 512, 1024, 2048)                 # lower edges of all but the first bucket
ASPECT_EDGES = (0.6, 0.8, 0.95, 1.05, 1.25, 1.67)
BRIGHTNESS_STEP = 32
BOX_COUNT_EDGES = (1, 2, 3, 5, 9, 17)
BRIGHTNESS_SAMPLES_PER_SIDE = 32

Observation = tuple[str, str]   # (feature, bucket)


def lower_edges(edges: Sequence[float]) -> tuple[str, ...]:
    """Bucket names for the ranges that `edges` split [0, inf) into: each its lower edge."""
    return ("0", *(f"{edge:g}" for edge in edges))


BUCKETS: Mapping[str, tuple[str, ...]] = {
    "format": FORMATS,
    "width": lower_edges(SIDE_EDGES_PX),
    "height": lower_edges(SIDE_EDGES_PX),
    "aspect": lower_edges(ASPECT_EDGES),
    "brightness": tuple(str(low) for low in range(0, 256, BRIGHTNESS_STEP)),
    "class": tuple(f"r{index:02d}" for index in range(CLASS_RANGES)),
    "confidence": tuple(f"{tenth / 10:.1f}" for tenth in range(10)),
    "boxes": lower_edges(BOX_COUNT_EDGES),
}
INPUT_FEATURES = ("format", "width", "height", "aspect", "brightness")
CLASSIFICATION_FEATURES = (*INPUT_FEATURES, "class", "confidence")
DETECTION_FEATURES = (*INPUT_FEATURES, "class", "confidence", "boxes")


def bucket_of(edges: Sequence[float], value: float, names: Sequence[str]) -> str:
    """The name of the range of `edges` that holds `value` (a lower edge belongs to its range)."""
    return names[bisect.bisect_right(edges, value)]


def class_range(index: int, class_count: int) -> str:
    """The class range of class `index` out of `class_count` (CLASS_RANGES equal ranges)."""
    if not 0 <= index < class_count:
        raise ValueError(f"class index {index} is outside 0..{class_count - 1}")
    return BUCKETS["class"][index * CLASS_RANGES // class_count]


def confidence_tenth(probability: float) -> str:
    """The tenth that holds a probability or score in [0, 1] (1.0 counts in the top one)."""
    return BUCKETS["confidence"][min(9, max(0, int(probability * 10)))]


def mean_brightness(image: torch.Tensor) -> float:
    """Mean luma (BT.601, 0-255) of `uint8[3, H, W]` over a grid of about 32x32 pixels: the
    cost does not grow with the image."""
    return mean_brightnesses([image])[0]


def mean_brightnesses(images: Sequence[torch.Tensor]) -> list[float]:
    """`mean_brightness` of each image, in order, read from the images' device in one copy: on a
    GPU one synchronisation for the batch, not one per image, and the images of one size
    sampled and averaged together (a few operations per distinct size, not per image)."""
    if not images:
        return []
    by_size: dict[tuple[int, ...], list[int]] = {}
    for index, image in enumerate(images):
        by_size.setdefault(tuple(image.shape), []).append(index)
    groups = list(by_size.values())
    means = torch.cat([_luma_means(torch.stack([_grid_sample(images[index]) for index in indices]))
                       for indices in groups]).tolist()
    order = [index for indices in groups for index in indices]
    brightness = [0.0] * len(images)
    for index, mean in zip(order, means, strict=True):
        brightness[index] = mean
    return brightness


def _grid_sample(image: torch.Tensor) -> torch.Tensor:
    """The about 32x32 pixels of `uint8[3, H, W]` that its brightness is the mean luma of (a view)."""
    _, height, width = image.shape
    step_y = max(1, height // BRIGHTNESS_SAMPLES_PER_SIDE)
    step_x = max(1, width // BRIGHTNESS_SAMPLES_PER_SIDE)
    return image[:, ::step_y, ::step_x]


def _luma_means(samples: torch.Tensor) -> torch.Tensor:
    """`uint8[N, 3, h, w]` samples of same-sized images -> `float32[N]` mean luma (BT.601)."""
    sample = samples.float()
    luma = 0.299 * sample[:, 0] + 0.587 * sample[:, 1] + 0.114 * sample[:, 2]
    return luma.mean(dim=(1, 2))


def input_observations(image_format: str, width: int, height: int, brightness: float) -> list[Observation]:
    """One image's input buckets: its header's format and stored size, its mean brightness."""
    return [("format", image_format if image_format in FORMATS else FORMATS[0]),
            ("width", bucket_of(SIDE_EDGES_PX, width, BUCKETS["width"])),
            ("height", bucket_of(SIDE_EDGES_PX, height, BUCKETS["height"])),
            ("aspect", bucket_of(ASPECT_EDGES, width / height, BUCKETS["aspect"])),
            ("brightness", BUCKETS["brightness"][min(7, int(brightness) // BRIGHTNESS_STEP)])]


def classification_observations(answer: Sequence[Mapping[str, Any]], class_count: int) -> list[Observation]:
    """A classifier's answer (top-k, best first: `index`, `probability`) -> its top-1 buckets."""
    if not answer:
        return []
    best = answer[0]
    return [("class", class_range(int(best["index"]), class_count)),
            ("confidence", confidence_tenth(float(best["probability"])))]


def detection_observations(answer: Iterable[Mapping[str, Any]], class_count: int) -> list[Observation]:
    """A detector's answer (boxes with `index` and `score`) -> a class and a confidence bucket per
    box, and the image's box count."""
    observations: list[Observation] = []
    for box in answer:
        observations += [("class", class_range(int(box["index"]), class_count)),
                         ("confidence", confidence_tenth(float(box["score"])))]
    count = sum(feature == "class" for feature, _ in observations)
    observations.append(("boxes", bucket_of(BOX_COUNT_EDGES, count, BUCKETS["boxes"])))
    return observations
