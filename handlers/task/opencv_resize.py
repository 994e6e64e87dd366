"""OpenCV's bilinear resize of uint8 images (`cv2.resize(..., interpolation=cv2.INTER_LINEAR)`),
the same integers on every device, as tensor operations.

Ultralytics' `predict` letterboxes with it, so an Ultralytics export answers as Ultralytics does
only from these pixels (the project's antialiased resize moved a calibrated YOLOv8n's detections
as much as another interpolation does). OpenCV (imgproc/src/resize.cpp, `resizeGeneric_` with
`HResizeLinear` and `VResizeLinear` for 8-bit images) computes, per axis, for output `d` the
source position `f = float((d + 0.5) * scale - 0.5)` (scale = input / output, in double), its
floor `s` and fraction; along the width a position left of the first pixel or at or past the last
takes that pixel alone, along the height the rows are clamped to the image and the fraction kept.
The weights are `round((1 - fraction) * 2048)` and `round(fraction * 2048)` (half to even, in
float32). The width pass sums two weighted pixels in int32 (up to 255 x 2048); the height pass
combines two such rows as OpenCV's vector code does, `((row0 >> 4) * w0 >> 16) + ((row1 >> 4) *
w1 >> 16)`, then `(sum + 2) >> 2` clamped to 0..255 (its scalar code rounds otherwise, by one
level at times; OpenCV 5's loop takes every pixel of a row through the vector arithmetic).
tests/unit/test_opencv_resize.py holds this to `cv2.resize` bit for bit over photos and random
sizes, up and down.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

WEIGHT_SCALE = 2048          # INTER_RESIZE_COEF_SCALE: 11 fractional bits


@lru_cache(maxsize=512)
def _axis_table(input_size: int, output_size: int, clamp_fraction: bool,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first source index, second source index, first weight, second weight) per output, on
    `device` (int64 indices, int32 weights), as OpenCV computes them for one axis."""
    scale = 1.0 / (output_size / input_size)
    position = ((np.arange(output_size, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    first = np.floor(position).astype(np.int64)
    fraction = (position - first.astype(np.float32)).astype(np.float32)
    if clamp_fraction:      # the width: outside the image, the edge pixel alone
        outside = (first < 0) | (first >= input_size - 1)
        fraction[outside] = 0
        first = np.clip(first, 0, input_size - 1)
    weight0 = np.rint((np.float32(1) - fraction) * np.float32(WEIGHT_SCALE)).astype(np.int32)
    weight1 = np.rint(fraction * np.float32(WEIGHT_SCALE)).astype(np.int32)
    second = np.clip(first + 1, 0, input_size - 1)
    first = np.clip(first, 0, input_size - 1)
    return (torch.from_numpy(first).to(device), torch.from_numpy(second).to(device),
            torch.from_numpy(weight0).to(device), torch.from_numpy(weight1).to(device))


def linear_resize_uint8(images: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """`uint8[..., C, H, W]` -> `uint8[..., C, h, w]`, what `cv2.resize` with INTER_LINEAR gives
    for the same pixels (channel order does not matter: every channel is resized alike). The
    input is not modified; an image already of that size is returned as it is."""
    height, width = int(images.shape[-2]), int(images.shape[-1])
    out_h, out_w = size_hw
    if (height, width) == (out_h, out_w):
        return images
    x0, x1, wx0, wx1 = _axis_table(width, out_w, True, images.device)
    y0, y1, wy0, wy1 = _axis_table(height, out_h, False, images.device)
    pixels = images.to(torch.int32)
    rows = pixels.index_select(-1, x0) * wx0 + pixels.index_select(-1, x1) * wx1     # [..., H, w]
    top = (rows.index_select(-2, y0) >> 4) * wy0[:, None] >> 16
    bottom = (rows.index_select(-2, y1) >> 4) * wy1[:, None] >> 16
    return ((top + bottom + 2) >> 2).clamp_(0, 255).to(torch.uint8)
