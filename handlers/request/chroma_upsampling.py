"""Subsampled JPEG chroma interpolated as libjpeg does, after a decoder that repeats it.

A JPEG stores its two chroma planes at half width (4:2:2) or half width and height (4:2:0), one
chroma sample per 2x1 or 2x2 block of pixels. libjpeg-turbo (the CPU's decoder) interpolates
them back to full size with a triangular filter ("fancy upsampling": each output sample 3/4 of
the nearer input sample and 1/4 of the next, in each subsampled direction); nvJPEG, a GPU's
decoder through torchvision, repeats each sample over its block. On the project's photos that
alone moves a classifier's probabilities by up to 0.034 (docs/precision.md, "CPU and GPU").

`interpolated_chroma` turns a decoded RGB image with repeated chroma into the interpolated one,
as tensor operations on the image's device: each block's chroma sample is estimated from the
block's RGB (the rounded mean of its Cb and Cr, which the block shares), the samples are
upsampled with libjpeg's filter and rounding (`jdsample.c`: h2v2 and h2v1 fancy upsampling, edge
samples repeated), and the change in chroma is added to the RGB through libjpeg's fixed-point
YCbCr -> RGB tables (`jdcolor.c`), so luma is left as the decoder gave it. Channels the decoder
clamped to 0 or 255 cannot be recovered exactly; they are clamped again.

`replicates_chroma` tells whether a decoder needs it, by decoding a small 4:2:0 JPEG with strong
colour edges both ways and comparing with libjpeg's (the CPU's) pixels.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

# Subsampling factors (horizontal, vertical) of the chroma planes this module interpolates.
H2V2 = (2, 2)     # 4:2:0
H2V1 = (2, 1)     # 4:2:2
INTERPOLATED = (H2V2, H2V1)

_SCALE_BITS = 16
_ONE_HALF = 1 << (_SCALE_BITS - 1)


def _fix(x: float) -> int:
    return int(x * (1 << _SCALE_BITS) + 0.5)


def _red_from_cr(cr: torch.Tensor) -> torch.Tensor:
    return (_fix(1.40200) * (cr - 128) + _ONE_HALF) >> _SCALE_BITS


def _blue_from_cb(cb: torch.Tensor) -> torch.Tensor:
    return (_fix(1.77200) * (cb - 128) + _ONE_HALF) >> _SCALE_BITS


def _green_from_chroma(cb: torch.Tensor, cr: torch.Tensor) -> torch.Tensor:
    return (-_fix(0.34414) * (cb - 128) + _ONE_HALF - _fix(0.71414) * (cr - 128)) >> _SCALE_BITS


def block_samples(images: torch.Tensor, factors: tuple[int, int]) -> torch.Tensor:
    """`uint8[N, 3, H, W]` RGB -> each chroma block's (Cb, Cr) sample, `int32[N, 2, ceil(H/v),
    ceil(W/h)]`: the rounded mean over the block's pixels (a block cut by the image's edge: over
    those inside), computed from the block's mean RGB (the conversion is linear)."""
    kernel = (factors[1], factors[0])
    red, green, blue = F.avg_pool2d(images.float(), kernel, ceil_mode=True, count_include_pad=False).unbind(1)
    cb = -0.168736 * red - 0.331264 * green + 0.5 * blue + 128
    cr = 0.5 * red - 0.418688 * green - 0.081312 * blue + 128
    return torch.stack([cb, cr], 1).round().clamp(0, 255).to(torch.int32)


def _edge_repeated(samples: torch.Tensor, dim: int) -> torch.Tensor:
    size = samples.shape[dim]
    return torch.cat([samples.narrow(dim, 0, 1), samples, samples.narrow(dim, size - 1, 1)], dim)


def _column_phases(sums: torch.Tensor, bias: tuple[int, int], shift: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """libjpeg's horizontal step: from `[..., w]` (weighted) samples, the left and right output
    column of each sample: (3 this + previous + bias[0]) >> shift, (3 this + next + bias[1]) >> shift."""
    padded = _edge_repeated(sums, -1)
    middle = 3 * padded[..., 1:-1]
    return (middle + padded[..., :-2] + bias[0]) >> shift, (middle + padded[..., 2:] + bias[1]) >> shift


def fancy_phases(samples: torch.Tensor, factors: tuple[int, int]) -> list[list[torch.Tensor]]:
    """`int32[..., h, w]` chroma samples -> libjpeg's fancy-upsampled values at each position of
    a block, `phases[row][column]`, each `int32[..., h, w]` (h2v2: rows weighted 3:1 then columns
    3:1, rounding +8 / +7 over 16; h2v1: columns 3:1, rounding +1 / +2 over 4)."""
    if factors == H2V2:
        rows = _edge_repeated(samples, -2)
        upper = 3 * rows[..., 1:-1, :] + rows[..., :-2, :]
        lower = 3 * rows[..., 1:-1, :] + rows[..., 2:, :]
        return [list(_column_phases(upper, (8, 7), 4)), list(_column_phases(lower, (8, 7), 4))]
    if factors == H2V1:
        return [list(_column_phases(samples, (1, 2), 2))]
    raise ValueError(f"chroma subsampling {factors} is not interpolated here")


def _interleaved(phases: list[list[torch.Tensor]], height: int, width: int) -> torch.Tensor:
    """`phases[row][column]`, each `[..., h, w]` -> `[..., h * rows, w * columns]` cut to
    `height` x `width`: the value of each block position in its place."""
    rows = [torch.stack(row, -1).flatten(-2) for row in phases]        # [..., h, w * columns]
    return torch.stack(rows, -2).flatten(-3, -2)[..., :height, :width]


def fancy_upsampled(samples: torch.Tensor, factors: tuple[int, int], height: int, width: int) -> torch.Tensor:
    """`int32[..., h, w]` chroma samples -> `int32[..., height, width]` as libjpeg's fancy
    upsampling gives them."""
    return _interleaved(fancy_phases(samples, factors), height, width)


def _rgb_from_chroma(cb: torch.Tensor, cr: torch.Tensor) -> torch.Tensor:
    """What chroma adds to luma in libjpeg's YCbCr -> RGB (before clamping), `[N, 3, ...]`."""
    return torch.stack([_red_from_cr(cr), _green_from_chroma(cb, cr), _blue_from_cb(cb)], 1)


def interpolated_chroma(images: torch.Tensor, factors: tuple[int, int]) -> torch.Tensor:
    """`uint8[..., 3, H, W]` decoded with each chroma sample repeated over its block (`factors`:
    H2V2 or H2V1, as stored, before any EXIF orientation) -> the same images with their chroma
    interpolated as libjpeg interpolates it, in one pass over a batch of equal size. Other
    factors: the images themselves. The chroma arithmetic runs at the samples' resolution; at
    full resolution only the mean, the interleaving of the change and its addition."""
    if factors not in INTERPOLATED:
        return images
    height, width = images.shape[-2:]
    batch = images.reshape(-1, 3, height, width)
    samples = block_samples(batch, factors)
    repeated = _rgb_from_chroma(samples[:, 0], samples[:, 1])
    change = [[(_rgb_from_chroma(phase[:, 0], phase[:, 1]) - repeated).to(torch.int16) for phase in row]
              for row in fancy_phases(samples, factors)]
    fixed = batch.to(torch.int16) + _interleaved(change, height, width)
    return fixed.clamp(0, 255).to(torch.uint8).reshape(images.shape)


def probe_jpeg() -> bytes:
    """A 64x48 4:2:0 JPEG (quality 95) of hue bands and sharp colour edges: where repeated and
    interpolated chroma differ most."""
    image = Image.new("RGB", (64, 48))
    draw = ImageDraw.Draw(image)
    for x in range(64):
        draw.line([(x, 0), (x, 23)], fill=(255 - 4 * x, 4 * x, 128))
    for index, colour in enumerate([(255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 0)]):
        draw.rectangle([index * 16 + 3, 24, index * 16 + 12, 47], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=95, subsampling=2)
    return buffer.getvalue()


def replicates_chroma(decode: Callable[[bytes], torch.Tensor], reference: torch.Tensor) -> bool:
    """Whether `decode` repeats 4:2:0 chroma: its pixels for `probe_jpeg()` come at least twice
    as close to `reference` (libjpeg's pixels for the same bytes) once interpolated here. A
    decoder that interpolates itself comes out further away (its chroma smoothed twice)."""
    decoded = decode(probe_jpeg()).cpu()

    def mean_error(image: torch.Tensor) -> float:
        return (image.to(torch.int32) - reference.to(torch.int32)).abs().float().mean().item()

    return mean_error(interpolated_chroma(decoded, H2V2)) * 2 < mean_error(decoded)
