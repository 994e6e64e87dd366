"""Geometry and normalization as tensor operations on the worker's device.

Images of a batch differ in size: those of one size are resized and cropped together (one
tensor operation per size, with the same uint8 arithmetic on every device:
handlers.task.fixed_point_resize); the crops are then normalized as one batch. An archive that
must resize as Pillow does (`preprocess.resize: pillow`: an Ultralytics classification export,
whose own preprocessing is torchvision's `Resize` on a PIL image) has each image resized by
Pillow itself, on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from handlers.task import resize_kernels
from handlers.task.fixed_point_resize import resize_uint8

# Whose resize: the project's (ATen's uint8 antialiased arithmetic, on every device) or Pillow's.
ResizeLibrary = Literal["torchvision", "pillow"]


def resized_size_hw(size_hw: tuple[int, int], short_side: int) -> tuple[int, int]:
    """The (height, width) after resizing the short side to `short_side`, keeping aspect ratio.

    Matches `torchvision.transforms.v2.functional.resize(image, [short_side])`.
    """
    height, width = size_hw
    if height <= width:
        return short_side, int(short_side * width / height)
    return int(short_side * height / width), short_side


def resize_and_center_crop(images: torch.Tensor, resize_size: int, crop_size: int) -> torch.Tensor:
    """`uint8[..., 3, H, W]` -> `uint8[..., 3, crop_size, crop_size]`: short side to `resize_size`
    (bilinear, antialiased), then the central `crop_size` square. The input is not modified."""
    resized = resize_uint8(images, resized_size_hw((images.shape[-2], images.shape[-1]), resize_size))
    return F.center_crop(resized, [crop_size, crop_size])


def resized_crops(images: Sequence[torch.Tensor], resize_size: int, crop_size: int,
                  device: torch.device) -> torch.Tensor:
    """Decoded `uint8[3, H_i, W_i]` images -> `uint8[B, 3, crop, crop]` on `device`, in order:
    `resize_and_center_crop` once per distinct size."""
    by_size = indices_by_size(images)
    if len(by_size) == 1:       # one size: no scatter into a batch (an index made on the host)
        return resize_and_center_crop(stacked([image.to(device, non_blocking=True) for image in images]),
                                      resize_size, crop_size)
    crops = torch.empty((len(images), 3, crop_size, crop_size), dtype=torch.uint8, device=device)
    for indices in by_size.values():
        same_size = stacked([images[index].to(device, non_blocking=True) for index in indices])
        crops[indices] = resize_and_center_crop(same_size, resize_size, crop_size)
    return crops


def pillow_resized_crops(images: Sequence[torch.Tensor], resize_size: int, crop_size: int,
                         device: torch.device) -> torch.Tensor:
    """`resized_crops` with each image resized by Pillow (`Image.resize(..., BILINEAR)`, what
    torchvision's `Resize` does to a PIL image) on the host, then centre-cropped as
    torchvision's `CenterCrop` crops, on `device`."""
    crops = []
    for image in images:
        height, width = resized_size_hw((int(image.shape[-2]), int(image.shape[-1])), resize_size)
        pixels = Image.fromarray(image.permute(1, 2, 0).cpu().numpy())
        # a writable array: torch warns (once per process, in the worker's log) on a read-only one
        resized = np.array(pixels.resize((width, height), Image.Resampling.BILINEAR))
        crops.append(F.center_crop(torch.from_numpy(resized).permute(2, 0, 1), [crop_size, crop_size]))
    return torch.stack(crops).to(device, non_blocking=True)


def indices_by_size(images: Sequence[torch.Tensor]) -> dict[tuple[int, int], list[int]]:
    """The images' indices grouped by their (height, width), sizes in order of first appearance."""
    by_size: dict[tuple[int, int], list[int]] = {}
    for index, image in enumerate(images):
        by_size.setdefault((image.shape[-2], image.shape[-1]), []).append(index)
    return by_size


def stacked(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """Same-sized `[3, H, W]` images as one `[N, 3, H, W]` batch, kept channels-last when they all
    are (libjpeg-turbo's decodes are `[H, W, 3]` in memory): stacking those into a contiguous
    NCHW batch transposes every pixel, and the CPU's uint8 resize is faster channels-last
    (2-core AVX2 EPYC, eight 720x720 photos: stack and resize 35 ms as NCHW, 7 ms channels-last)."""
    pixels_last = [image.permute(1, 2, 0) for image in images]
    if all(view.is_contiguous() for view in pixels_last):
        return torch.stack(pixels_last).permute(0, 3, 1, 2)
    return torch.stack(list(images))


def normalize_batch(
    batch_uint8: torch.Tensor, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype
) -> torch.Tensor:
    """`uint8[B, 3, H, W]` -> `dtype[B, 3, H, W]`: scaled to [0, 1], then (x - mean) / std, as
    torchvision's `normalize` computes it, with mean and std kept on the device."""
    scaled = F.to_dtype(batch_uint8, torch.float32, scale=True)
    mean_t, std_t = channel_constants(tuple(mean), tuple(std), batch_uint8.device)
    return scaled.sub_(mean_t).div_(std_t).to(dtype)


@lru_cache(maxsize=64)
def channel_constants(mean: tuple[float, ...], std: tuple[float, ...],
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[C, 1, 1]` mean and std on `device`, made once (not copied there every batch)."""
    if any(value == 0 for value in std):
        raise ValueError(f"std has a zero, which normalization would divide by: {std}")
    return (torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1).to(device),
            torch.tensor(std, dtype=torch.float32).view(-1, 1, 1).to(device))


def preprocess_classification_batch(
    images: Sequence[torch.Tensor],
    resize_size: int,
    crop_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    kernels: bool = False,
    resize: ResizeLibrary = "torchvision",
) -> torch.Tensor:
    """Decoded `uint8[3, H_i, W_i]` images -> one normalized `dtype[B, 3, crop, crop]` batch on
    `device`; with `kernels`, by handlers.task.resize_kernels (the same values, per size); with
    `resize="pillow"`, resized by Pillow (`pillow_resized_crops`).
    Raises ValueError for an empty sequence (a batch has at least one image)."""
    if not images:
        raise ValueError("preprocess_classification_batch needs at least one image")
    if resize == "pillow":
        return normalize_batch(pillow_resized_crops(images, resize_size, crop_size, device), mean, std, dtype)
    if kernels:
        return kernel_crops_normalized(images, resize_size, crop_size, mean, std, device, dtype)
    return normalize_batch(resized_crops(images, resize_size, crop_size, device), mean, std, dtype)


def kernel_crops_normalized(images: Sequence[torch.Tensor], resize_size: int, crop_size: int,
                            mean: Sequence[float], std: Sequence[float], device: torch.device,
                            dtype: torch.dtype) -> torch.Tensor:
    """`preprocess_classification_batch`'s batch from handlers.task.resize_kernels: each size's
    images resized, cropped and normalized by two kernel launches, straight into the batch."""
    mean_t, std_t = (values.view(-1) for values in channel_constants(tuple(mean), tuple(std), device))
    by_size = indices_by_size(images)
    batches = []
    for size_hw, indices in by_size.items():
        same_size = stacked([images[index].to(device, non_blocking=True) for index in indices])
        batches.append(resize_kernels.resized_crops_normalized(
            same_size, resized_size_hw(size_hw, resize_size), crop_size, mean_t, std_t, dtype))
    if len(batches) == 1:
        return batches[0]
    batch = torch.empty((len(images), *batches[0].shape[1:]), dtype=dtype, device=device)
    for indices, part in zip(by_size.values(), batches, strict=True):
        batch[indices] = part
    return batch
