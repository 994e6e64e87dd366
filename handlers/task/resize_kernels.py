"""The classifier's resize, centre crop and normalisation as two Triton kernel launches, with
the same values as the tensor operations (fixed_point_resize's arithmetic, torchvision's crop,
transforms.normalize_batch; tests/unit/test_preprocess_kernels.py) and no float32 copy of the
images: two passes of the fixed-point resize, tap by tap in int32 (the filter's few taps per
output, where the matrix products multiply by banded matrices that are about 99% zeros),
computing only the outputs the centre crop keeps; the second pass scales, normalises and casts as
`normalize_batch` does (a float32 multiply by 1/255, a subtraction and a correctly rounded
division, compiled without fused multiply-add) and writes the network's input. The CUDA worker's
choice: the archive's `cuda_preprocess_kernels`.
"""

from __future__ import annotations

import functools

import torch

from handlers.ground.triton_kernels import INTERPRETED_ELEMENTS, launchable, no_fp_fusion, require, tl, triton
from handlers.task.fixed_point_resize import axis_taps

BLOCK_OTHER = 32         # a program on CUDA: rows (or columns) beside ...
BLOCK_POSITIONS = 32     # ... outputs along the resized axis

# The dtypes the second pass writes itself (rounded to nearest even, compiled and interpreted);
# another (bf16: the interpreter truncates to it) is cast from float32 by torch.
KERNEL_OUTPUTS = (torch.float32, torch.float16)

# The kernel's integer arguments: sizes, strides and the filter's taps and precision, which change
# with every photo size. Triton would otherwise compile a kernel for each new combination of their
# divisibility by 16 (and of those equal to 1) on a request's time; unspecialised, one kernel per
# pass and output dtype serves every size, compiled when the worker warms up (`warm_up`).
SIZE_ARGUMENTS = ("channels", "source_image", "source_channel", "source_other", "source_position",
                  "target_image", "target_channel", "target_other", "target_position",
                  "others", "positions", "source_length", "precision", "taps")

if triton is not None:
    @triton.jit(do_not_specialize=SIZE_ARGUMENTS)
    def _resample_kernel(source, target, first, weights, channels,  # type: ignore[no-untyped-def]
                         source_image, source_channel, source_other, source_position,
                         target_image, target_channel, target_other, target_position,
                         others, positions, source_length, precision, taps,
                         mean, std, scale,
                         NORMALIZE: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_P: tl.constexpr):
        """One fixed-point pass along one axis: target[n, c, o, p] from source[n, c, o, first[p]
        + t] (t < taps, clamped to the source), weighted by weights[p, t]; with NORMALIZE, the
        uint8 result scaled, normalised and cast to the target's dtype. The taps are a loop
        bound, not a constant: a filter's width changes with the resize's ratio."""
        plane = tl.program_id(0)
        image = plane // channels
        channel = plane % channels
        other = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        position = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        other_in = other < others
        position_in = position < positions
        start = tl.load(first + position, mask=position_in, other=0)
        source_base = source + image.to(tl.int64) * source_image + channel * source_channel
        total = tl.full((BLOCK_O, BLOCK_P), 0, tl.int32) + (1 << (precision - 1))
        for tap in range(taps):
            weight = tl.load(weights + position * taps + tap, mask=position_in, other=0)
            index = tl.minimum(start + tap, source_length - 1)
            value = tl.load(source_base + other[:, None] * source_other + index[None, :] * source_position,
                            mask=other_in[:, None] & position_in[None, :], other=0)
            total += value.to(tl.int32) * weight[None, :]
        pixel = tl.minimum(tl.maximum(total >> precision, 0), 255)
        at = (target + image.to(tl.int64) * target_image + channel * target_channel
              + other[:, None] * target_other + position[None, :] * target_position)
        inside = other_in[:, None] & position_in[None, :]
        if NORMALIZE:
            scaled = pixel.to(tl.float32) * scale
            normal = tl.div_rn(scaled - tl.load(mean + channel), tl.load(std + channel))
            tl.store(at, normal.to(target.dtype.element_ty), mask=inside)
        else:
            tl.store(at, pixel.to(tl.uint8), mask=inside)


def _resize_blocks(device: torch.device, others: int, positions: int) -> tuple[int, int]:
    """(rows or columns, outputs) per program of a pass."""
    if device.type == "cuda":
        return BLOCK_OTHER, BLOCK_POSITIONS
    block_positions = triton.next_power_of_2(positions)
    block_others = min(triton.next_power_of_2(others), max(1, INTERPRETED_ELEMENTS // block_positions))
    return block_others, block_positions


@functools.lru_cache(maxsize=256)
def _crop_taps(input_size: int, output_size: int, start: int, count: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The fixed-point filter's outputs `start .. start + count - 1` on `device`: their first
    input (int32), their weights (int32 `[count, taps]`), the taps and the precision."""
    taps = axis_taps(input_size, output_size)
    first = torch.tensor(taps.first[start:start + count], dtype=torch.int32)
    weights = torch.tensor(taps.weights[start:start + count], dtype=torch.int32)
    return first.to(device), weights.contiguous().to(device), taps.taps, taps.precision


def _pass(source: torch.Tensor, target: torch.Tensor, axis: int, input_size: int, output_size: int,
          start: int, normalize: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """One resize pass of `source` `[N, C, H, W]` along `axis` (-1: width, -2: height) into
    `target`, outputs `start ..` of a resize from `input_size` to `output_size`."""
    count = target.shape[axis]
    first, weights, taps, precision = _crop_taps(input_size, output_size, start, count, source.device)
    other_axis = -2 if axis == -1 else -1
    others = target.shape[other_axis]
    mean, std = normalize if normalize is not None else (first, first)   # unread without NORMALIZE
    block_others, block_positions = _resize_blocks(source.device, others, count)
    grid = (target.shape[0] * target.shape[1], triton.cdiv(others, block_others),
            triton.cdiv(count, block_positions))
    launchable(_resample_kernel, source.device)[grid](
        source, target, first, weights, target.shape[1],
        source.stride(0), source.stride(1), source.stride(other_axis), source.stride(axis),
        target.stride(0), target.stride(1), target.stride(other_axis), target.stride(axis),
        others, count, input_size, precision, taps, mean, std, 1.0 / 255,
        NORMALIZE=normalize is not None, BLOCK_O=block_others, BLOCK_P=block_positions,
        **no_fp_fusion(source.device))


def resized_crops_normalized(images: torch.Tensor, resized_hw: tuple[int, int], crop_size: int,
                             mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`uint8[N, C, H, W]` -> `dtype[N, C, crop, crop]`: what `normalize_batch(center_crop(
    resize_uint8(images, resized_hw)))` gives, bit for bit, from two passes that compute only
    the cropped outputs. `mean` and `std` are float32 `[C]` on the images' device; the resized
    size holds the crop (a centre crop that pads is not computed here)."""
    require()
    count, channels, height, width = images.shape
    out_h, out_w = resized_hw
    if out_h < crop_size or out_w < crop_size:
        raise ValueError(f"a {out_h}x{out_w} resize does not hold a {crop_size} crop")
    top, left = _crop_start(out_h, crop_size), _crop_start(out_w, crop_size)
    columns = torch.empty((count, channels, height, crop_size), dtype=torch.uint8, device=images.device)
    _pass(images, columns, -1, width, out_w, left, None)
    written = dtype if dtype in KERNEL_OUTPUTS else torch.float32
    out = torch.empty((count, channels, crop_size, crop_size), dtype=written, device=images.device)
    _pass(columns, out, -2, height, out_h, top, (mean, std))
    return out.to(dtype)


def _crop_start(size: int, crop: int) -> int:
    """torchvision's `center_crop` offset: int(round((size - crop) / 2.0))."""
    return round((size - crop) / 2.0)


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """Compile both passes for `dtype` batches on `device` (one kernel each for every photo size:
    SIZE_ARGUMENTS), so that no request waits for Triton's compiler."""
    images = torch.zeros((1, 3, 40, 48), dtype=torch.uint8, device=device)
    mean = torch.zeros(3, dtype=torch.float32, device=device)
    resized_crops_normalized(images, (32, 38), 32, mean, torch.ones_like(mean), dtype)
