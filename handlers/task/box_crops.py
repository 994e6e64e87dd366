"""Crops of detected boxes for a second model, for a whole batch in one operation.

All boxes of all images are resampled to `size x size` by one `torchvision.ops.roi_align` call
(bilinear, with as many samples per output pixel as the box needs: a large box is averaged down,
not aliased). Images of different sizes are padded to a common size by repeating their edge
pixels, which gives every box the same samples it would get from its image alone (roi_align clamps
samples at the image edge to the edge pixel; the repeated edge is that pixel).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as nn_functional
from torchvision.ops import roi_align


def padded_batch(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """`uint8[3, H_i, W_i]` images -> `float[B, 3, H_max, W_max]` (values 0..255), each image at
    the top left, its last row and column repeated into the padding."""
    height = max(image.shape[-2] for image in images)
    width = max(image.shape[-1] for image in images)
    padded = []
    for image in images:
        extra_h, extra_w = height - image.shape[-2], width - image.shape[-1]
        as_float = image.float().unsqueeze(0)
        if extra_h or extra_w:
            as_float = nn_functional.pad(as_float, (0, extra_w, 0, extra_h), mode="replicate")
        padded.append(as_float)
    return torch.cat(padded)


def crop_boxes(images: Sequence[torch.Tensor], boxes_xyxy: Sequence[torch.Tensor],
               size: int) -> torch.Tensor:
    """Each image's boxes (`float[N_i, 4]` xyxy in its pixels, inside it) -> `float[sum N_i, 3,
    size, size]` crops with values 0..255, in order (image 0's boxes first). Zero boxes in all:
    an empty `[0, 3, size, size]` tensor. Images and boxes are not modified."""
    device = images[0].device
    if sum(len(boxes) for boxes in boxes_xyxy) == 0:
        return torch.zeros(0, 3, size, size, device=device)
    return roi_align(padded_batch(images), [boxes.float().to(device) for boxes in boxes_xyxy],
                     output_size=(size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
