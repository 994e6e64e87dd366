"""Letterboxing for fixed-input detectors: resize keeping aspect ratio, pad to the input size.

Two geometries and resizes: the generic YOLO-style path's (a square input, centred with the odd
pixel after, the project's antialiased resize) and Ultralytics' own (`LetterBox` in
ultralytics/data/augment.py, what its `predict` does for a fixed-size export: any input height
and width, each side rounded half to even, its pads split by `round(d - 0.1)` / `round(d + 0.1)`,
OpenCV's bilinear resize: handlers.task.opencv_resize).

The parameters of each letterbox are returned with the image and passed to postprocessing,
which maps boxes back with them; they are never re-derived from shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchvision.ops import clip_boxes_to_image
from torchvision.transforms.v2 import functional as F

from handlers.task.fixed_point_resize import resize_uint8
from handlers.task.opencv_resize import linear_resize_uint8


@dataclass(frozen=True)
class Letterbox:
    """How one image was placed in the square model input.

    The original `original_hw` image was resized to `resized_hw` and pasted at
    (`pad_left`, `pad_top`) into an `input_hw` canvas.
    """

    original_hw: tuple[int, int]
    resized_hw: tuple[int, int]
    pad_top: int
    pad_left: int
    input_hw: tuple[int, int]

    @property
    def scale_y(self) -> float:
        return self.resized_hw[0] / self.original_hw[0]

    @property
    def scale_x(self) -> float:
        return self.resized_hw[1] / self.original_hw[1]


def letterbox_geometry(original_hw: tuple[int, int], input_size: int) -> Letterbox:
    """The largest aspect-preserving fit of `original_hw` into the square, centred."""
    height, width = original_hw
    ratio = min(input_size / height, input_size / width)
    resized_h = max(1, min(input_size, round(height * ratio)))
    resized_w = max(1, min(input_size, round(width * ratio)))
    return Letterbox(original_hw, (resized_h, resized_w), (input_size - resized_h) // 2,
                     (input_size - resized_w) // 2, (input_size, input_size))


def ultralytics_geometry(original_hw: tuple[int, int], input_hw: tuple[int, int]) -> Letterbox:
    """Ultralytics' `LetterBox` for a fixed-size export (scale up allowed, centred, no stride
    rounding): the ratio min(H / h, W / w), each side `max(round(side * ratio), 1)` (Python's
    round, half to even), the top and left pads `round(pad / 2 - 0.1)`."""
    height, width = original_hw
    ratio = min(input_hw[0] / height, input_hw[1] / width)
    resized_h, resized_w = max(round(height * ratio), 1), max(round(width * ratio), 1)
    pad_h, pad_w = (input_hw[0] - resized_h) / 2, (input_hw[1] - resized_w) / 2
    return Letterbox(original_hw, (resized_h, resized_w), round(pad_h - 0.1), round(pad_w - 0.1), input_hw)


def placed(resized: torch.Tensor, geometry: Letterbox, fill: int) -> torch.Tensor:
    """`uint8[C, h, w]` already resized to `geometry.resized_hw` -> the `uint8[C, H, W]` canvas of
    `fill` with it at the geometry's pads."""
    canvas = torch.full((resized.shape[0], *geometry.input_hw), fill, dtype=resized.dtype,
                        device=resized.device)
    top, left = geometry.pad_top, geometry.pad_left
    canvas[:, top: top + geometry.resized_hw[0], left: left + geometry.resized_hw[1]] = resized
    return canvas


def letterbox_image(image: torch.Tensor, input_size: int, fill: int) -> tuple[torch.Tensor, Letterbox]:
    """`uint8[3, H, W]` -> (`uint8[3, S, S]`, its Letterbox). The input is not modified."""
    geometry = letterbox_geometry((image.shape[-2], image.shape[-1]), input_size)
    return placed(resize_uint8(image, geometry.resized_hw), geometry, fill), geometry


def letterbox_batch(images: Sequence[torch.Tensor], input_size: int, fill: int,
                    device: torch.device) -> tuple[torch.Tensor, list[Letterbox]]:
    """Decoded images -> (`float32[B, 3, S, S]` in [0, 1] on `device`, one Letterbox per image)."""
    if not images:
        raise ValueError("letterbox_batch needs at least one image")
    boxed = [letterbox_image(image.to(device, non_blocking=True), input_size, fill) for image in images]
    batch = torch.stack([canvas for canvas, _ in boxed])
    return F.to_dtype(batch, torch.float32, scale=True), [geometry for _, geometry in boxed]


def ultralytics_letterbox_batch(images: Sequence[torch.Tensor], input_hw: tuple[int, int], fill: int,
                                device: torch.device) -> tuple[torch.Tensor, list[Letterbox]]:
    """Decoded `uint8[3, H_i, W_i]` images -> (`float32[B, 3, H, W]` on `device`, one Letterbox per
    image): each as Ultralytics' predict prepares it (`ultralytics_geometry`, OpenCV's bilinear
    resize, the pads filled with `fill`), divided by 255 as it divides."""
    if not images:
        raise ValueError("ultralytics_letterbox_batch needs at least one image")
    boxed = [ultralytics_letterboxed(image.to(device, non_blocking=True), input_hw, fill) for image in images]
    return torch.stack([canvas for canvas, _ in boxed]).float().div_(255), [geometry for _, geometry in boxed]


def ultralytics_letterboxed(image: torch.Tensor, input_hw: tuple[int, int],
                            fill: int) -> tuple[torch.Tensor, Letterbox]:
    """`uint8[3, H, W]` -> (`uint8[3, input_hw]` as Ultralytics' LetterBox makes it, its Letterbox)."""
    geometry = ultralytics_geometry((int(image.shape[-2]), int(image.shape[-1])), input_hw)
    return placed(linear_resize_uint8(image, geometry.resized_hw), geometry, fill), geometry


def boxes_to_original(boxes_xyxy: torch.Tensor, letterbox: Letterbox) -> torch.Tensor:
    """`float[N, 4]` xyxy in model-input pixels -> xyxy in original pixels, clipped to the image.

    Returns a new tensor; the input is not modified.
    """
    offset = boxes_xyxy.new_tensor([letterbox.pad_left, letterbox.pad_top] * 2)
    scale = boxes_xyxy.new_tensor([letterbox.scale_x, letterbox.scale_y] * 2)
    return clip_boxes_to_image((boxes_xyxy - offset) / scale, letterbox.original_hw)


def boxes_to_letterbox(boxes_xyxy: torch.Tensor, letterbox: Letterbox) -> torch.Tensor:
    """The inverse of `boxes_to_original` (without clipping): original pixels -> model input."""
    offset = boxes_xyxy.new_tensor([letterbox.pad_left, letterbox.pad_top] * 2)
    scale = boxes_xyxy.new_tensor([letterbox.scale_x, letterbox.scale_y] * 2)
    return boxes_xyxy * scale + offset
