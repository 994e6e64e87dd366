"""The uint8 resize: the CPU's fixed-point kernel, reproduced as tensor operations for other
devices, bit for bit (the GPU test module checks the same on CUDA)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn import functional as F

from handlers.task.fixed_point_resize import axis_taps, device_matrices, resize_exact, resize_uint8


def aten_uint8(images: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    return F.interpolate(images, size=list(size_hw), mode="bilinear", antialias=True,
                         align_corners=False)


def random_images(count: int, height: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, height, width), dtype=torch.uint8, generator=generator)


def size_pairs(count: int, seed: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    rng = random.Random(seed)
    return [((rng.randint(1, 700), rng.randint(1, 700)), (rng.randint(1, 400), rng.randint(1, 400)))
            for _ in range(count)]


@pytest.mark.parametrize(("input_hw", "output_hw"), [
    ((720, 720), (256, 256)), ((427, 640), (256, 383)), ((300, 451), (256, 384)),
    ((1200, 1600), (300, 400)), ((48, 64), (256, 341)), ((7, 5), (3, 11)), ((1, 1), (4, 4)),
    *size_pairs(40, seed=0),
])
def test_the_exact_resize_is_the_cpu_kernel_bit_for_bit(input_hw, output_hw):
    images = random_images(2, input_hw[0], input_hw[1], seed=sum(input_hw) + sum(output_hw))
    assert torch.equal(resize_exact(images, output_hw), aten_uint8(images, output_hw))


@pytest.mark.parametrize(("input_hw", "output_hw"), [
    ((720, 720), (256, 256)), ((1080, 1440), (256, 341)), ((3000, 40), (256, 9)), ((33, 4000), (5, 341)),
])
def test_both_ways_of_a_pass_are_the_cpu_kernel_at_the_largest_sums_too(input_hw, output_hw):
    """The matrix products (one, or two by weight bytes where one would pass float32's exact
    integers: 1080, 3000 and 4000 pixels here) and the gathers, on random pixels and on the
    patterns whose sums are largest (all 255) or alternate between the ends."""
    height, width = input_hw
    stripes = (torch.arange(width) % 2 * 255).to(torch.uint8).expand(2, 3, height, width)
    for images in (random_images(2, height, width, seed=height + width),
                   torch.full((2, 3, height, width), 255, dtype=torch.uint8), stripes.contiguous()):
        expected = aten_uint8(images, output_hw)
        assert torch.equal(resize_exact(images, output_hw), expected)
        assert torch.equal(resize_exact(images, output_hw, method="gathers"), expected)


def tf32(values: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32 (10 explicit mantissa bits), to nearest, as CUDA's matrix
    products may round their inputs."""
    bits = values.view(torch.int32)
    return ((bits + (1 << 12)) & ~((1 << 13) - 1)).view(torch.float32)


@pytest.mark.parametrize(("input_size", "output_size"), [(720, 256), (1080, 256), (12000, 256), (48, 256),
                                                       (4000, 3)])
def test_every_factor_of_a_pass_is_exact_in_tf32_and_every_sum_in_float32(input_size, output_size):
    """So a CUDA worker's resize is exact whatever its TF32 setting: the weights' digits and the
    0..255 pixels are integers TF32 holds, each output a sum of products below 2**24 (a filter of
    over a thousand taps, 4000 -> 3, in digits of fewer bits)."""
    digits, bits, _ = device_matrices(input_size, output_size, torch.device("cpu"))
    for digit in digits:
        assert torch.equal(tf32(digit), digit) and int(digit.max()) < 1 << bits <= 256
        assert 255 * int(digit.sum(dim=0).max()) < 1 << 24
    pixels = torch.arange(256, dtype=torch.float32)
    assert torch.equal(tf32(pixels), pixels)
    weights = torch.zeros(output_size, dtype=torch.int64)
    for digit in digits:
        weights = (weights << bits) + digit.to(torch.int64).sum(dim=0)
    assert torch.equal(weights.unique(), torch.unique(torch.tensor(
        [sum(row) for row in axis_taps(input_size, output_size).weights])))
    byte_sums_fit = 255 * axis_taps(input_size, output_size).taps * 255 < 1 << 24
    assert bits == 8 if byte_sums_fit else bits < 8


def test_a_real_photo_resizes_identically():
    from torchvision.io import decode_image

    from tests.images import photo_bytes

    photo = decode_image(torch.frombuffer(bytearray(photo_bytes("rocket.jpg")), dtype=torch.uint8))
    assert torch.equal(resize_exact(photo, (256, 383)), aten_uint8(photo[None], (256, 383))[0])


def test_resize_uint8_keeps_the_shape_it_was_given_and_leaves_the_input_untouched():
    images = random_images(3, 40, 60, seed=1)
    before = images.clone()
    assert resize_uint8(images, (20, 30)).shape == (3, 3, 20, 30)
    assert resize_uint8(images[0], (20, 30)).shape == (3, 20, 30)
    assert torch.equal(resize_uint8(images[0], (20, 30)), resize_uint8(images, (20, 30))[0])
    assert torch.equal(images, before)
    assert resize_uint8(images, (40, 60)) is images


def test_resize_uint8_refuses_float_images():
    with pytest.raises(TypeError):
        resize_uint8(torch.zeros(3, 4, 4), (2, 2))


@pytest.mark.parametrize(("input_size", "output_size"), [(720, 256), (256, 720), (427, 383), (5, 3)])
def test_each_outputs_weights_fit_int16_and_sum_to_one_in_fixed_point(input_size, output_size):
    taps = axis_taps(input_size, output_size)
    unit = 1 << taps.precision
    assert len(taps.first) == output_size
    for first, weights in zip(taps.first, taps.weights, strict=True):
        assert 0 <= first < input_size
        assert all(-(1 << 15) <= weight < (1 << 15) for weight in weights)
        assert abs(sum(weights) - unit) <= len(weights)   # each weight rounded by at most 1/2


def test_a_channels_last_batch_resizes_as_a_contiguous_one():
    images = random_images(2, 50, 70, seed=3)
    pixels_last = images.contiguous(memory_format=torch.channels_last)
    assert torch.equal(resize_exact(pixels_last, (20, 30)), aten_uint8(images, (20, 30)))
    assert torch.equal(resize_uint8(pixels_last, (20, 30)), aten_uint8(images, (20, 30)))
