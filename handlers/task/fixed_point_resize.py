"""One antialiased bilinear resize of uint8 images, with the same arithmetic on every device.

On the CPU, `torch.nn.functional.interpolate(uint8, antialias=True)` (what torchvision's
`resize` calls for uint8 there) computes in fixed point: per axis, the filter's weights in
double, rounded to int16 at the largest precision under which the axis's largest weight still
fits, each output an integer dot product plus half a unit, shifted down and clamped to 0..255;
width first, then height, through a uint8 intermediate. On CUDA, `interpolate` has no uint8
antialiased kernel, and torchvision resizes in float and rounds: outputs one level apart from
the CPU's, which moved EfficientNet-Lite0's probabilities by up to 0.045 on the project's photos
(docs/precision.md). Here the CPU keeps ATen's kernel (vectorised) and every other device runs
`resize_exact`: the same integer arithmetic as tensor operations, bit for bit equal to the CPU's
(tests/unit/test_fixed_point_resize.py). Each pass is a float32 matrix product by the axis's
weights laid out as banded `[input, output]` matrices of the weights' digits (their high and low
bytes; smaller digits, in more matrices, for a filter so wide that a byte's sums would not fit):
every factor is an integer of at most 255, which TF32 (CUDA's float32 matrix products where the
worker allows them: handlers.model.model_loading.use_tensor_float_32) holds exactly as float32
does, and every partial sum a non-negative integer below 2**24, which the products accumulate
exactly in float32 whatever the order of summation; so each product is an integer dot product,
the products recombined in int32, whatever the process's TF32 setting. (The other way,
`method="gathers"`: one int32 gather, multiply and add per tap, a kernel each, which on an H200
took more GPU time than the model: docs/benchmarks.md.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
from torch.nn import functional as F

INT16_LIMIT = 1 << 15
MAX_PRECISION_BITS = 22
FLOAT32_EXACT = 1 << 24          # float32 holds every integer below this exactly
DIGIT_BITS = 8                   # a byte: TF32 holds every integer up to 2**11 exactly

# How a pass computes its integer dot products (module docstring); both give the same integers.
ResampleMethod = Literal["matmul", "gathers"]


@dataclass(frozen=True)
class AxisTaps:
    """One axis's fixed-point filter: output i reads inputs `first[i] .. first[i] + taps - 1`
    (clamped to the input) with int16 `weights[i]` (zero past the filter's support), scaled by
    2**`precision`."""

    first: tuple[int, ...]
    weights: tuple[tuple[int, ...], ...]
    precision: int

    @property
    def taps(self) -> int:
        return len(self.weights[0])


def _triangle(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _trunc(value: float) -> int:
    """C's `(int64_t) value` / `(int) value`: toward zero."""
    return int(value)


@lru_cache(maxsize=512)
def axis_taps(input_size: int, output_size: int) -> AxisTaps:
    """ATen's `_compute_index_ranges_int16_weights` for the antialiased bilinear filter
    (align_corners false, no scale factor), in the same double arithmetic and order."""
    scale = input_size / output_size
    support = scale if scale >= 1.0 else 1.0          # interp_size 2, times 0.5, times the scale
    max_taps = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    firsts: list[int] = []
    rows: list[list[float]] = []
    wt_max = 0.0
    for i in range(output_size):
        center = scale * (i + 0.5)
        xmin = max(_trunc(center - support + 0.5), 0)
        xsize = min(max(min(_trunc(center + support + 0.5), input_size) - xmin, 0), max_taps)
        row = [_triangle((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
        total = 0.0
        for weight in row:
            total += weight
        if total != 0.0:
            row = [weight / total for weight in row]
            wt_max = max([wt_max, *row])
        firsts.append(xmin)
        rows.append(row + [0.0] * (max_taps - xsize))
    precision = 0
    while precision < MAX_PRECISION_BITS:
        if _trunc(0.5 + wt_max * (1 << (precision + 1))) >= INT16_LIMIT:
            break
        precision += 1
    unit = 1 << precision
    weights = tuple(tuple(_trunc(-0.5 + w * unit) if w * unit < 0 else _trunc(0.5 + w * unit)
                          for w in row) for row in rows)
    return AxisTaps(tuple(firsts), weights, precision)


def _tap_tables(input_size: int, output_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`axis_taps` as CPU tensors: the input index each tap reads, `int64[taps, output]` (clamped
    to the input: past the support the weight is 0), its weight, `int32[taps, output]`, and the
    precision."""
    taps = axis_taps(input_size, output_size)
    first = torch.tensor(taps.first, dtype=torch.int64)
    index = (first[None, :] + torch.arange(taps.taps)[:, None]).clamp_(max=input_size - 1)
    weights = torch.tensor(taps.weights, dtype=torch.int32).T.contiguous()
    return index, weights, taps.precision


@lru_cache(maxsize=512)
def device_taps(input_size: int, output_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`_tap_tables` on `device`, made once per (sizes, device)."""
    index, weights, precision = _tap_tables(input_size, output_size)
    return index.to(device), weights.to(device), precision


@lru_cache(maxsize=512)
def device_matrices(input_size: int, output_size: int,
                    device: torch.device) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """`axis_taps` as the float32 `[input, output]` matrices of the weights' digits, most
    significant first, on `device`, made once per (sizes, device), with the digits' width in
    bits and the precision. A digit is a byte, or fewer bits where 255 x a column's sum of one
    byte could reach 2**24 (a filter of hundreds of taps): so each product of a row of 0..255
    pixels is a sum of integers below 2**24, and no factor needs more than TF32's 11 significant
    bits."""
    index, weights, precision = _tap_tables(input_size, output_size)
    outputs = torch.arange(output_size).expand_as(index)
    matrix = torch.zeros(input_size, output_size, dtype=torch.int64).index_put_(
        (index, outputs), weights.to(torch.int64), accumulate=True)   # clamped taps add 0
    bits = DIGIT_BITS
    while bits > 1 and 255 * int((matrix > 0).sum(dim=0).max()) * ((1 << bits) - 1) >= FLOAT32_EXACT:
        bits -= 1
    count = max(1, -(-int(matrix.max()).bit_length() // bits))
    digits = [(matrix >> (bits * place)) & ((1 << bits) - 1) for place in reversed(range(count))]
    return tuple(digit.to(torch.float32).to(device) for digit in digits), bits, precision


def _resample_last_axis(images: torch.Tensor, output_size: int,
                        method: ResampleMethod = "matmul") -> torch.Tensor:
    """Integer `[..., L]` holding 0..255 -> int32 `[..., output]` holding 0..255: one fixed-point
    pass, as two matrix products or as a gather per tap."""
    if method == "gathers":
        index, weights, precision = device_taps(images.shape[-1], output_size, images.device)
        total = torch.full((*images.shape[:-1], output_size), 1 << (precision - 1),
                           dtype=torch.int32, device=images.device)
        wide = images.to(torch.int32)
        for tap in range(index.shape[0]):
            total += wide.index_select(-1, index[tap]) * weights[tap]
        return (total >> precision).clamp_(0, 255)
    matrices, bits, precision = device_matrices(images.shape[-1], output_size, images.device)
    pixels = images.to(torch.float32)
    total = torch.zeros((), dtype=torch.int32, device=images.device)
    for matrix in matrices:           # most significant digit first
        total = (total << bits) + (pixels @ matrix).to(torch.int32)
    return ((total + (1 << (precision - 1))) >> precision).clamp_(0, 255)


def resize_exact(images: torch.Tensor, size_hw: tuple[int, int],
                 method: ResampleMethod = "matmul") -> torch.Tensor:
    """`uint8[..., H, W]` -> `uint8[..., h, w]` with the CPU's fixed-point arithmetic (see the
    module docstring), on the images' device. The input is not modified."""
    height, width = images.shape[-2:]
    out_h, out_w = size_hw
    result = images
    if out_w != width:
        result = _resample_last_axis(result, out_w, method)
    if out_h != height:
        result = _resample_last_axis(result.transpose(-1, -2), out_h, method).transpose(-1, -2)
    return result.to(torch.uint8).contiguous()


def aten_kernel_serves(device: torch.device) -> bool:
    """Whether ATen's own uint8 kernel resizes on `device` (the CPU's); elsewhere `resize_exact`."""
    return device.type == "cpu"


def resize_uint8(images: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """`uint8[N, C, H, W]` (or `[C, H, W]`) -> the same at `size_hw`: antialiased bilinear with
    one arithmetic on every device (ATen's kernel on the CPU, `resize_exact` elsewhere)."""
    if images.dtype != torch.uint8:
        raise TypeError(f"resize_uint8 takes uint8 images, got {images.dtype}")
    if tuple(images.shape[-2:]) == tuple(size_hw):
        return images
    if not aten_kernel_serves(images.device):
        return resize_exact(images, size_hw)
    batch = images if images.ndim == 4 else images.unsqueeze(0)
    resized = F.interpolate(batch, size=list(size_hw), mode="bilinear", antialias=True,
                            align_corners=False)
    return resized if images.ndim == 4 else resized[0]
