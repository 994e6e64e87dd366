from __future__ import annotations

import pytest
import torch

from handlers.task.letterbox import (
    boxes_to_letterbox,
    boxes_to_original,
    letterbox_batch,
    letterbox_geometry,
    letterbox_image,
)

SIZES_HW = [(480, 640), (640, 480), (500, 500), (37, 1001), (1001, 37), (3000, 4000)]


@pytest.mark.parametrize(("size_hw", "resized_hw", "pad_top", "pad_left"), [
    ((480, 640), (480, 640), 80, 0),    # landscape: fits the width, pads top and bottom
    ((640, 480), (640, 480), 0, 80),    # portrait: fits the height, pads left and right
    ((500, 500), (640, 640), 0, 0),     # square: upscaled to fill
    ((3000, 4000), (480, 640), 80, 0),
])
def test_geometry_fits_the_long_side_and_centres(size_hw, resized_hw, pad_top, pad_left):
    geometry = letterbox_geometry(size_hw, 640)
    assert (geometry.resized_hw, geometry.pad_top, geometry.pad_left) == (resized_hw, pad_top, pad_left)


@pytest.mark.parametrize("size_hw", SIZES_HW)
def test_round_trip_original_letterbox_original_is_within_half_a_pixel(size_hw):
    geometry = letterbox_geometry(size_hw, 640)
    height, width = size_hw
    generator = torch.Generator().manual_seed(0)
    corners = torch.rand(200, 2, 2, generator=generator) * torch.tensor([width, height])
    boxes = torch.cat([corners.min(dim=1).values, corners.max(dim=1).values], dim=1)
    back = boxes_to_original(boxes_to_letterbox(boxes, geometry), geometry)
    assert (back - boxes).abs().max() < 0.5
    assert torch.equal(boxes, torch.cat([corners.min(dim=1).values, corners.max(dim=1).values], 1))


def test_boxes_are_clipped_to_the_original_image():
    geometry = letterbox_geometry((480, 640), 640)
    outside = torch.tensor([[-50.0, 0.0, 700.0, 640.0]])  # covers the padding and beyond
    assert boxes_to_original(outside, geometry).tolist() == [[0.0, 0.0, 640.0, 480.0]]


def test_letterboxed_image_has_the_picture_in_the_middle_and_fill_around():
    image = torch.full((3, 100, 200), 255, dtype=torch.uint8)
    canvas, geometry = letterbox_image(image, 64, fill=114)
    assert canvas.shape == (3, 64, 64)
    assert (geometry.resized_hw, geometry.pad_top) == ((32, 64), 16)
    assert torch.all(canvas[:, :16] == 114) and torch.all(canvas[:, 48:] == 114)
    assert torch.all(canvas[:, 16:48] == 255)
    assert torch.all(image == 255)  # input untouched


def test_batch_is_float_in_unit_range_with_one_letterbox_per_image():
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in SIZES_HW[:3]]
    batch, letterboxes = letterbox_batch(images, 320, 114, torch.device("cpu"))
    assert batch.shape == (3, 3, 320, 320) and batch.dtype == torch.float32
    assert float(batch.min()) >= 0.0 and float(batch.max()) <= 1.0
    assert [lb.original_hw for lb in letterboxes] == SIZES_HW[:3]
    alone, _ = letterbox_batch(images[1:2], 320, 114, torch.device("cpu"))
    assert torch.equal(alone[0], batch[1])
