"""Crops of boxes for a whole batch in one roi_align: the same as each image alone, at the borders
too, and close to torchvision's own resized crop."""

from __future__ import annotations

import torch
from torchvision.ops import roi_align
from torchvision.transforms.v2 import functional as F

from handlers.task.box_crops import crop_boxes, padded_batch


def images() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator)
            for height, width in ((50, 80), (96, 40), (64, 64))]


def alone(image: torch.Tensor, boxes: torch.Tensor, size: int) -> torch.Tensor:
    return roi_align(image.float()[None], [boxes], output_size=(size, size), sampling_ratio=-1,
                     aligned=True)


def test_a_batch_of_different_sizes_crops_every_box_as_its_image_alone_would():
    pictures = images()
    boxes = [torch.tensor([[0.0, 0.0, 80.0, 50.0], [60.5, 30.0, 80.0, 50.0]]),  # whole, corner
             torch.tensor([[10.0, 70.0, 40.0, 96.0]]),                        # bottom border
             torch.zeros(0, 4)]                                               # no boxes
    before = [image.clone() for image in pictures]
    crops = crop_boxes(pictures, boxes, 24)
    assert crops.shape == (3, 3, 24, 24)
    expected = torch.cat([alone(pictures[0], boxes[0], 24), alone(pictures[1], boxes[1], 24)])
    torch.testing.assert_close(crops, expected, rtol=0, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(pictures, before, strict=True))


def test_zero_boxes_in_the_whole_batch_give_an_empty_batch():
    assert crop_boxes(images(), [torch.zeros(0, 4)] * 3, 16).shape == (0, 3, 16, 16)


def test_padding_repeats_the_edge_pixels():
    padded = padded_batch(images()[:2])
    assert padded.shape == (2, 3, 96, 80)
    torch.testing.assert_close(padded[0, :, 70, 79], padded[0, :, 49, 79])
    torch.testing.assert_close(padded[1, :, 10, 60], padded[1, :, 10, 39])


def test_a_crop_looks_like_torchvisions_resized_crop():
    image = F.resize(torch.arange(64, dtype=torch.float32).repeat(3, 64, 1), [128, 128]).to(torch.uint8)
    crop = crop_boxes([image], [torch.tensor([[16.0, 32.0, 80.0, 96.0]])], 32)[0]
    reference = F.resized_crop(image.float(), 32, 16, 64, 64, [32, 32], antialias=True)
    assert (crop - reference).abs().mean() < 1.0  # grey levels, of 0..255
