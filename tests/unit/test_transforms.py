from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from handlers.task.transforms import (
    normalize_batch,
    pillow_resized_crops,
    preprocess_classification_batch,
    resize_and_center_crop,
    resized_size_hw,
)

CPU = torch.device("cpu")


def random_image(height: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize(("size_hw", "expected"), [
    ((300, 451), (256, 384)),   # landscape: short side is the height
    ((640, 427), (383, 256)),   # portrait
    ((500, 500), (256, 256)),
    ((2, 4000), (256, 512000)),
])
def test_resized_size_keeps_aspect_ratio_like_torchvision(size_hw, expected):
    assert resized_size_hw(size_hw, 256) == expected
    if max(expected) < 5000:
        assert tuple(F.resize(torch.zeros(3, *size_hw), [256]).shape[1:]) == expected


@pytest.mark.parametrize("size_hw", [(300, 451), (640, 427), (224, 224), (17, 900)])
def test_resize_and_center_crop_gives_the_crop_size(size_hw):
    out = resize_and_center_crop(random_image(size_hw[0], size_hw[1], seed=0), 256, 224)
    assert out.shape == (3, 224, 224) and out.dtype == torch.uint8


def test_center_crop_takes_the_middle():
    image = torch.zeros(3, 256, 400, dtype=torch.uint8)
    image[:, :, 88:312] = 200  # the central 224 columns
    out = resize_and_center_crop(image, 256, 224)  # short side already 256: crop only
    assert torch.all(out == 200)
    image[:, :, 87] = 200
    image[:, :, 88] = 0  # one column inside the crop window changed: the crop sees it
    assert resize_and_center_crop(image, 256, 224)[:, :, 0].max() == 0


def test_normalize_maps_0_and_255_to_minus_one_and_one_with_half_mean_std():
    batch = torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1).expand(2, 3, 2, 2)
    out = normalize_batch(batch, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), torch.float32)
    assert torch.allclose(out[0], torch.full((3, 2, 2), -1.0))
    assert torch.allclose(out[1], torch.full((3, 2, 2), 1.0))


def test_normalize_uses_per_channel_mean_and_std():
    batch = torch.full((1, 3, 1, 1), 51, dtype=torch.uint8)  # 0.2
    out = normalize_batch(batch, (0.1, 0.2, 0.3), (0.1, 0.5, 0.2), torch.float32)
    assert torch.allclose(out.flatten(), torch.tensor([1.0, 0.0, -0.5]), atol=1e-6)


def test_batch_preprocessing_equals_each_image_alone_and_leaves_inputs_untouched():
    images = [random_image(300, 451, 1), random_image(640, 427, 2), random_image(224, 224, 3)]
    copies = [image.clone() for image in images]
    batch = preprocess_classification_batch(images, 256, 224, (0.5,) * 3, (0.5,) * 3, CPU)
    assert batch.shape == (3, 3, 224, 224) and batch.dtype == torch.float32
    for index, image in enumerate(images):
        alone = preprocess_classification_batch([image], 256, 224, (0.5,) * 3, (0.5,) * 3, CPU)
        assert torch.equal(batch[index], alone[0])
    assert all(torch.equal(a, b) for a, b in zip(images, copies, strict=True))


def test_empty_batch_is_refused():
    with pytest.raises(ValueError, match="at least one image"):
        preprocess_classification_batch([], 256, 224, (0.5,) * 3, (0.5,) * 3, CPU)


def test_decoded_images_stack_channels_last_and_crop_as_one_by_one():
    from torchvision.io import decode_jpeg

    from handlers.task.transforms import resized_crops, stacked
    from tests.images import encode, textured_rgb

    decoded = [decode_jpeg(torch.frombuffer(bytearray(encode(textured_rgb(90, 120, seed=s), "JPEG")),
                                            dtype=torch.uint8)) for s in range(3)]
    batch = stacked(decoded)
    assert batch.shape == (3, 3, 90, 120) and batch.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(batch[i], decoded[i]) for i in range(3))
    mixed = [*decoded, random_image(70, 50, seed=9)]
    crops = resized_crops(mixed, 72, 64, CPU)
    for image, crop in zip(mixed, crops, strict=True):
        assert torch.equal(crop, resize_and_center_crop(image, 72, 64))


def test_normalize_gives_torchvisions_normalize_bit_for_bit():
    generator = torch.Generator().manual_seed(5)
    batch = torch.randint(0, 256, (4, 3, 17, 23), dtype=torch.uint8, generator=generator)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    expected = F.normalize(F.to_dtype(batch, torch.float32, scale=True), list(mean), list(std))
    assert torch.equal(normalize_batch(batch, mean, std, torch.float32), expected)


def test_pillow_resized_crops_are_pillows_resize_then_the_centre_crop_without_a_warning():
    images = [random_image(300, 451, seed=1), random_image(640, 427, seed=2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # torch warns on a read-only NumPy array
        crops = pillow_resized_crops(images, 256, 224, CPU)
    for image, crop in zip(images, crops, strict=True):
        height, width = resized_size_hw((int(image.shape[-2]), int(image.shape[-1])), 256)
        resized = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((width, height),
                                                                          Image.Resampling.BILINEAR)
        expected = F.center_crop(torch.from_numpy(np.array(resized)).permute(2, 0, 1), [224, 224])
        assert torch.equal(crop, expected)
