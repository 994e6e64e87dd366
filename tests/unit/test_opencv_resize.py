"""OpenCV's bilinear resize as tensor operations (handlers/task/opencv_resize.py) against
`cv2.resize(..., interpolation=cv2.INTER_LINEAR)` itself: bit for bit, up and down, on random
pixels, on the extremes and on photos."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from handlers.task.opencv_resize import linear_resize_uint8
from tests.images import PHOTOS_DIR


def opencv(image_hwc: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    return cv2.resize(image_hwc, (size_hw[1], size_hw[0]), interpolation=cv2.INTER_LINEAR)


def ours(image_hwc: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    return linear_resize_uint8(torch.from_numpy(image_hwc).permute(2, 0, 1), size_hw).permute(1, 2, 0).numpy()


@pytest.mark.parametrize("seed", range(6))
def test_random_sizes_up_and_down_are_opencvs_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    for _ in range(8):
        height, width = (int(side) for side in rng.integers(1, 900, 2))
        size_hw = (int(rng.integers(1, 700)), int(rng.integers(1, 700)))
        image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        assert np.array_equal(ours(image, size_hw), opencv(image, size_hw)), ((height, width), size_hw)


@pytest.mark.parametrize(("size_hw", "resized_hw"), [
    ((512, 512), (640, 640)), ((480, 640), (240, 320)), ((491, 640), (640, 834)), ((1, 1), (5, 7)),
    ((1000, 333), (640, 213)), ((7, 3000), (2, 640)), ((720, 1280), (360, 640)), ((2, 2), (1, 1)),
])
def test_the_extremes_of_each_channel_and_exact_ratios(size_hw, resized_hw):
    """All 255 (the largest sums), alternating 0 / 255 stripes (the largest differences), exact
    halvings (OpenCV's area path for a 2x reduction) and one-pixel sides."""
    height, width = size_hw
    stripes = np.zeros((height, width, 3), dtype=np.uint8)
    stripes[::2, 1::2] = 255
    stripes[1::2, ::2] = 255
    for image in (np.full((height, width, 3), 255, dtype=np.uint8), stripes):
        assert np.array_equal(ours(image, resized_hw), opencv(image, resized_hw))


@pytest.mark.parametrize("name", ["astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg"])
def test_photos_letterboxed_to_640_are_opencvs(name):
    image = np.array(Image.open(PHOTOS_DIR / name).convert("RGB"))  # writable: torch warns on a read-only one
    ratio = 640 / max(image.shape[:2])
    size_hw = (round(image.shape[0] * ratio), round(image.shape[1] * ratio))
    assert np.array_equal(ours(image, size_hw), opencv(image, size_hw))


def test_a_batch_is_each_image_alone_the_input_untouched_and_an_equal_size_returned_as_is():
    rng = np.random.default_rng(7)
    batch = torch.from_numpy(rng.integers(0, 256, (3, 3, 50, 70), dtype=np.uint8))
    before = batch.clone()
    resized = linear_resize_uint8(batch, (31, 44))
    assert resized.dtype == torch.uint8 and resized.shape == (3, 3, 31, 44)
    for index in range(3):
        assert torch.equal(resized[index], linear_resize_uint8(batch[index], (31, 44)))
    assert torch.equal(batch, before)
    assert linear_resize_uint8(batch, (50, 70)) is batch
