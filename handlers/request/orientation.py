"""EXIF orientation applied to a decoded image as a tensor operation, on the image's device.

A decoder that returns the stored pixels (nvJPEG ignores orientation; the batched JPEG decode
here asks torchvision for stored pixels on the CPU too) is followed by `oriented`, so a photo a
phone stored sideways is served upright on every device. The eight values are those of the
EXIF / TIFF specification, applied as Pillow's `ImageOps.exif_transpose` does (tested equal).
"""

from __future__ import annotations

import torch

H, W = -2, -1


def oriented(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """`[..., H, W]` stored pixels -> display orientation. 1 (or an unknown value) returns the
    image itself; 5 to 8 swap height and width. The input is not modified."""
    if orientation == 2:
        return image.flip(W)
    if orientation == 3:
        return image.flip(H, W)
    if orientation == 4:
        return image.flip(H)
    if orientation == 5:
        return image.transpose(H, W).contiguous()
    if orientation == 6:
        return torch.rot90(image, -1, (H, W))
    if orientation == 7:
        return image.transpose(H, W).flip(H, W)
    if orientation == 8:
        return torch.rot90(image, 1, (H, W))
    return image
