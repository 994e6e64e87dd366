"""The preprocessing kernels (Triton, run here by its interpreter) against the CPU's functions
they stand in for on a CUDA worker: bit for bit (tests/gpu checks the compiled kernels on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as torch_functional
from torchvision.transforms.v2 import functional as F

from handlers.ground.limits import ImageLimits, SettingsError
from handlers.model.settings import parse_classifier_settings
from handlers.request import chroma_kernels
from handlers.request.chroma_upsampling import H2V1, H2V2, block_samples
from handlers.request.chroma_upsampling import interpolated_chroma as chroma_by_tensor_ops
from handlers.request.decode import decode_with_headers
from handlers.task import resize_kernels
from handlers.task.fixed_point_resize import resize_uint8
from handlers.task.transforms import (
    channel_constants,
    normalize_batch,
    preprocess_classification_batch,
    resized_size_hw,
)
from tests import libjpeg_turbo
from tests.unit.test_chroma_upsampling import PILLOW_SUBSAMPLING, photo_jpeg, use_libjpeg_as_batched_decoder
from tests.unit.test_settings import MINIMAL
from torchserve_vision.photo_sets import project_photos

# Triton's interpreter computes each kernel operation in NumPy, tile by tile: about 16 s for the
# module on a 2-core machine, a third of the fast tier's test time. The whole suite runs it.
pytestmark = pytest.mark.slow
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def random_images(count: int, height: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, height, width), dtype=torch.uint8, generator=generator)


def reference_crops(images: torch.Tensor, resized_hw: tuple[int, int], crop: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """What the tensor-operation path gives on the CPU: ATen's resize, torchvision's centre crop,
    normalize_batch."""
    crops = F.center_crop(resize_uint8(images, resized_hw), [crop, crop])
    return normalize_batch(crops, MEAN, STD, dtype)


def kernel_crops(images: torch.Tensor, resized_hw: tuple[int, int], crop: int,
                 dtype: torch.dtype) -> torch.Tensor:
    mean, std = (values.view(-1) for values in channel_constants(MEAN, STD, images.device))
    return resize_kernels.resized_crops_normalized(images, resized_hw, crop, mean, std, dtype)


@pytest.mark.parametrize(("input_hw", "crop", "dtype"), [
    ((720, 720), 224, torch.float16), ((720, 720), 224, torch.float32), ((427, 640), 224, torch.float32),
    ((640, 427), 224, torch.bfloat16), ((301, 451), 240, torch.float32), ((256, 300), 224, torch.float16),
    ((1080, 1440), 224, torch.float32), ((250, 250), 224, torch.float32),
])
def test_resize_crop_and_normalize_in_two_passes_are_the_cpus_bit_for_bit(input_hw, crop, dtype):
    """Short side to 256 (the classifier's resize), only the crop's outputs computed, scaled and
    normalised in the second pass: equal to the CPU's resize, crop and normalisation; on random
    pixels, all 255 (the largest sums) and stripes alternating between the ends."""
    height, width = input_hw
    resized_hw = resized_size_hw(input_hw, 256)
    stripes = (torch.arange(width) % 2 * 255).to(torch.uint8).expand(1, 3, height, width).contiguous()
    for images in (random_images(2, height, width, seed=height * width),
                   torch.full((1, 3, height, width), 255, dtype=torch.uint8), stripes):
        expected = reference_crops(images, resized_hw, crop, dtype)
        got = kernel_crops(images, resized_hw, crop, dtype)
        assert got.dtype == dtype and got.shape == expected.shape
        assert torch.equal(got, expected), (input_hw, (got.float() - expected.float()).abs().max())


def test_the_passes_read_any_layout_of_the_batch():
    """A channels-last batch (as the CPU's decoder stacks) and a strided view give the same."""
    images = random_images(2, 300, 400, seed=3)
    expected = reference_crops(images, (256, 341), 224, torch.float32)
    channels_last = images.contiguous(memory_format=torch.channels_last)
    assert torch.equal(kernel_crops(channels_last, (256, 341), 224, torch.float32), expected)
    wider = random_images(2, 300, 500, seed=4)
    wider[..., :400] = images
    assert torch.equal(kernel_crops(wider[..., :400], (256, 341), 224, torch.float32), expected)


def test_a_resize_smaller_than_the_crop_is_refused():
    with pytest.raises(ValueError, match="does not hold"):
        kernel_crops(random_images(1, 100, 100, seed=0), (200, 200), 224, torch.float32)


@pytest.mark.parametrize("factors", [H2V2, H2V1], ids=["4:2:0", "4:2:2"])
@pytest.mark.parametrize("height_width", [(48, 64), (37, 51), (1, 1), (2, 3), (255, 1025)])
def test_the_chroma_kernels_are_interpolated_chroma_bit_for_bit(factors, height_width):
    """Random pixels (blocks of every mean, so every rounding of the block's sample, ties
    included, and every clamp), odd sizes (blocks cut by the edges), a single pixel."""
    height, width = height_width
    images = random_images(2, height, width, seed=height + width + factors[1])
    got = chroma_kernels.interpolated_chroma(images, factors)
    assert torch.equal(got, chroma_by_tensor_ops(images, factors))
    assert torch.equal(images, random_images(2, height, width, seed=height + width + factors[1]))


def one_channel_blocks(channel: int) -> torch.Tensor:
    """`uint8[1, 3, 2, W]`, zero in two channels; in `channel`, 2x2 blocks whose pixels sum to
    each level 0..1023 (clamped to 255), each followed by a block of 255 (so that the fancy
    upsampling of every pixel depends on its block's sample). Blue alone gives Cb = 128 + mean / 2,
    red alone Cr = 128 + mean / 2: every mean at a quarter level, many samples on .5 exactly."""
    levels = torch.arange(0, 1024, dtype=torch.int32)
    base, extra = levels // 4, levels % 4
    block = torch.stack([base + (extra > 0), base + (extra > 1), base + (extra > 2), base], 1).clamp(0, 255)
    blocks = torch.stack([block, torch.full_like(block, 255)], 1).reshape(-1, 4)
    images = torch.zeros((1, 3, 2, 2 * len(blocks)), dtype=torch.uint8)
    images[0, channel] = blocks.view(-1, 2, 2).permute(1, 0, 2).reshape(2, -1).to(torch.uint8)
    return images


def half_to_even(values: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to the nearest integer, an exact half to the even neighbour."""
    floor = torch.floor(values)
    fraction = values - floor
    up = (fraction > 0.5) | ((fraction == 0.5) & (floor.to(torch.int64) % 2 == 1))
    return (floor + up.to(values.dtype)).to(torch.int32)


@pytest.mark.parametrize(("channel", "plane"), [(2, 0), (0, 1)], ids=["cb-from-blue", "cr-from-red"])
def test_block_samples_round_half_to_even_as_the_cpu(channel, plane):
    """Flat-coloured blocks whose Cb (blue alone) or Cr (red alone) lands on .5 before rounding:
    the kernel's block samples are the exact means rounded half to even, as the CPU's tensor
    operations round them, and its interpolated pixels are theirs; a kernel that rounds halves
    up or down fails here."""
    images = one_channel_blocks(channel)
    means = torch_functional.avg_pool2d(images.double(), (2, 2))[0, channel, 0]   # exact: sums / 4
    exact = 128 + means / 2
    assert (exact % 1 == 0.5).sum() >= 100                          # the ties the test is about
    expected = half_to_even(exact).clamp(0, 255)
    assert torch.equal(block_samples(images, H2V2)[0, plane, 0], expected)
    assert torch.equal(chroma_kernels.block_samples(images, H2V2)[0, plane, 0], expected)
    for factors in (H2V2, H2V1):
        assert torch.equal(chroma_kernels.interpolated_chroma(images, factors),
                           chroma_by_tensor_ops(images, factors))


def test_the_chroma_kernels_on_a_photo_decoded_with_repeated_chroma():
    photo = project_photos()[0]
    data = photo_jpeg(photo.image, PILLOW_SUBSAMPLING[H2V2])
    repeated = libjpeg_turbo.decode(data, repeat_chroma=True).unsqueeze(0)
    assert torch.equal(chroma_kernels.interpolated_chroma(repeated, H2V2),
                       chroma_by_tensor_ops(repeated, H2V2))


def test_other_subsampling_is_left_as_it_is():
    images = random_images(1, 8, 8, seed=0)
    assert chroma_kernels.interpolated_chroma(images, (1, 1)) is images


def test_a_batch_of_several_sizes_by_the_kernels_is_the_tensor_operations_batch():
    """The classifier's preprocessing with `kernels` (each size's images in two launches,
    written into the batch in request order) against the same without."""
    images = [random_images(1, *size, seed=index)[0]
              for index, size in enumerate([(300, 400), (256, 256), (300, 400), (400, 300)])]
    device = torch.device("cpu")
    for dtype in (torch.float32, torch.float16):
        by_kernels = preprocess_classification_batch(images, 256, 224, MEAN, STD, device, dtype,
                                                     kernels=True)
        by_ops = preprocess_classification_batch(images, 256, 224, MEAN, STD, device, dtype)
        assert torch.equal(by_kernels, by_ops)


def test_the_batched_decode_interpolates_chroma_by_the_kernels_when_asked(monkeypatch):
    """The decode path of a worker whose decoder repeats chroma (nvJPEG; here libjpeg-turbo made
    to repeat it), with `use_chroma_kernels`: the same pixels as by tensor operations."""
    use_libjpeg_as_batched_decoder(monkeypatch, repeat_chroma=True, said_to_repeat=True)
    photo = project_photos()[1].image.resize((160, 120))
    encoded = [photo_jpeg(photo, PILLOW_SUBSAMPLING[H2V2]), photo_jpeg(photo, PILLOW_SUBSAMPLING[H2V1])]
    by_ops = [result for result, _ in decode_with_headers(encoded, ImageLimits())]
    by_kernels = [result for result, _ in
                  decode_with_headers(encoded, ImageLimits(), use_chroma_kernels=True)]
    for ops, kernels in zip(by_ops, by_kernels, strict=True):
        assert isinstance(kernels, torch.Tensor) and isinstance(ops, torch.Tensor)
        assert torch.equal(kernels, ops)


def test_the_archive_setting_is_a_switch():
    assert not parse_classifier_settings(MINIMAL).cuda_preprocess_kernels
    assert parse_classifier_settings({**MINIMAL, "cuda_preprocess_kernels": True}).cuda_preprocess_kernels
    with pytest.raises(SettingsError, match="cuda_preprocess_kernels"):
        parse_classifier_settings({**MINIMAL, "cuda_preprocess_kernels": "yes"})


# The kernels' tensor arguments (pointers, which Triton specialises on alignment only).
POINTERS = {"images", "samples", "out", "source", "target", "first", "weights", "mean", "std"}


@pytest.mark.parametrize("kernel", ["_block_samples_kernel", "_chroma_fix_kernel", "_resample_kernel"])
def test_no_size_or_stride_is_specialised_so_no_new_photo_size_compiles_a_kernel(kernel):
    """Every argument of each kernel is a tensor, a compile-time constant the worker's warm-up
    compiles (subsampling, blocks, NORMALIZE), a float, or an integer Triton is told not to
    specialise on: a photo of a new size reuses the warmed-up kernel."""
    module = chroma_kernels if kernel != "_resample_kernel" else resize_kernels
    function = getattr(module, kernel)
    plain = [param.name for param in function.params
             if not param.is_constexpr and param.name not in POINTERS and param.name != "scale"]
    assert plain and set(plain) <= set(module.SIZE_ARGUMENTS)
    assert all(param.do_not_specialize for param in function.params if param.name in plain)


def test_the_warm_ups_run_every_kernel_variant_a_worker_uses():
    chroma_kernels.warm_up(torch.device("cpu"))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        resize_kernels.warm_up(torch.device("cpu"), dtype)
