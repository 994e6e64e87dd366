"""EXIF orientation as a tensor operation: the same pixels as Pillow's exif_transpose."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from handlers.request.orientation import oriented


@pytest.mark.parametrize("orientation", range(1, 9))
def test_each_orientation_matches_pillows_exif_transpose(orientation):
    pixels = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3)).astype(np.uint8)
    image = Image.fromarray(pixels)
    image.getexif()[0x0112] = orientation
    expected = np.asarray(ImageOps.exif_transpose(image))
    got = oriented(torch.from_numpy(pixels).permute(2, 0, 1), orientation).permute(1, 2, 0).numpy()
    assert np.array_equal(got, expected)


def test_a_batch_turns_as_each_of_its_images():
    batch = torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8).reshape(2, 3, 4, 5)
    turned = oriented(batch, 6)
    assert turned.shape == (2, 3, 5, 4)
    assert torch.equal(turned[1], oriented(batch[1], 6))


@pytest.mark.parametrize("orientation", [0, 1, 9, 255])
def test_identity_and_unknown_values_return_the_image_itself(orientation):
    image = torch.zeros(3, 2, 4, dtype=torch.uint8)
    assert oriented(image, orientation) is image
