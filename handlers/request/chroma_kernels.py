"""`chroma_upsampling.interpolated_chroma` as two Triton kernels, with the same integers
(tests/unit/test_preprocess_kernels.py) and none of its full-size temporaries: one computes each
chroma block's (Cb, Cr) sample from the block's RGB in the same float32 operations, in the same
order, as `block_samples` (compiled without fused multiply-add, so each product and sum is
rounded as the CPU rounds it; the mean of at most four integers over 1, 2 or 4 is exact); the
other gives each pixel libjpeg's fancy-upsampled chroma from its block's and the neighbouring
blocks' samples, in integers, and writes the corrected uint8 pixel. A 64 x 3 x 720 x 720 batch is
read twice and written once as uint8, where the tensor operations made a float32 copy of it and
int16 and int32 temporaries. The CUDA worker's choice: the archive's `cuda_preprocess_kernels`.
"""

from __future__ import annotations

import torch

from handlers.ground.triton_kernels import (
    available,
    elementwise_block,
    launchable,
    no_fp_fusion,
    require,
    tl,
    triton,
)

__all__ = ["available", "block_samples", "interpolated_chroma", "warm_up"]

# Chroma subsampling factors (horizontal, vertical) the kernels interpolate.
H2V2 = (2, 2)
H2V1 = (2, 1)

# The kernels' integer arguments, which change with every photo size: unspecialised (Triton would
# compile a kernel for each new combination of their divisibility by 16 on a request's time), so
# that one kernel per subsampling serves every size, compiled when the worker warms up (`warm_up`).
SIZE_ARGUMENTS = ("height", "width", "block_rows", "block_cols", "image_stride", "channel_stride",
                  "row_stride")

if triton is not None:
    @triton.jit(do_not_specialize=SIZE_ARGUMENTS)
    def _block_samples_kernel(images, samples, height, width, block_rows, block_cols,  # type: ignore[no-untyped-def]
                              image_stride, channel_stride, row_stride,
                              V: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """samples[n, 0|1, by, bx] = the (Cb, Cr) of the block's mean RGB, rounded half to even."""
        n = tl.program_id(1)
        index = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        blocks = block_rows * block_cols
        inside = index < blocks
        by = index // block_cols
        bx = index % block_cols
        base = images + n.to(tl.int64) * image_stride
        red = tl.full((BLOCK_SIZE,), 0.0, tl.float32)
        green = tl.full((BLOCK_SIZE,), 0.0, tl.float32)
        blue = tl.full((BLOCK_SIZE,), 0.0, tl.float32)
        count = tl.full((BLOCK_SIZE,), 0.0, tl.float32)
        for dy in tl.static_range(V):
            for dx in tl.static_range(2):
                y = by * V + dy
                x = bx * 2 + dx
                present = inside & (y < height) & (x < width)
                pixel = base + y * row_stride + x
                red += tl.load(pixel, mask=present, other=0).to(tl.float32)
                green += tl.load(pixel + channel_stride, mask=present, other=0).to(tl.float32)
                blue += tl.load(pixel + 2 * channel_stride, mask=present, other=0).to(tl.float32)
                count += present.to(tl.float32)
        count = tl.maximum(count, 1.0)
        red = tl.div_rn(red, count)               # sums of at most 4 integers over 1, 2 or 4: exact
        green = tl.div_rn(green, count)
        blue = tl.div_rn(blue, count)
        out = samples + n.to(tl.int64) * 2 * blocks + index
        for plane in tl.static_range(2):
            if plane == 0:
                value = red * -0.168736 - green * 0.331264 + blue * 0.5 + 128.0
            else:
                value = red * 0.5 - green * 0.418688 - blue * 0.081312 + 128.0
            whole = tl.floor(value)                   # round half to even, as torch.round
            fraction = value - whole                  # exact: value is below 2**23
            odd = (whole.to(tl.int32) & 1) == 1
            rounded = whole + ((fraction > 0.5) | ((fraction == 0.5) & odd)).to(tl.float32)
            sample = tl.minimum(tl.maximum(rounded, 0.0), 255.0).to(tl.int32)
            tl.store(out + plane * blocks, sample, mask=inside)

    @triton.jit(do_not_specialize=SIZE_ARGUMENTS)
    def _chroma_fix_kernel(images, samples, out, height, width, block_rows, block_cols,  # type: ignore[no-untyped-def]
                           image_stride, channel_stride, row_stride,
                           V: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """out = each pixel's RGB plus the change from its block's chroma sample to libjpeg's
        fancy-upsampled chroma at the pixel (jdsample.c), through jdcolor.c's tables."""
        n = tl.program_id(1)
        index = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        inside = index < height * width
        index = tl.where(inside, index, 0)        # lanes past the image read pixel 0's blocks
        y = index // width
        x = index % width
        row = y // V
        col = x // 2
        first_column = (x % 2) == 0
        neighbour_row = tl.minimum(tl.maximum(tl.where((y % V) == 0, row - 1, row + 1), 0), block_rows - 1)
        side = tl.where(first_column, tl.maximum(col - 1, 0), tl.minimum(col + 1, block_cols - 1))
        blocks = block_rows * block_cols
        plane_base = samples + n.to(tl.int64) * 2 * blocks
        for plane in tl.static_range(2):
            plane_samples = plane_base + plane * blocks
            block = tl.load(plane_samples + row * block_cols + col)
            here = block
            beside = tl.load(plane_samples + row * block_cols + side)
            if V == 2:                            # h2v2: rows 3:1 first, then columns, over 16
                here = 3 * here + tl.load(plane_samples + neighbour_row * block_cols + col)
                beside = 3 * beside + tl.load(plane_samples + neighbour_row * block_cols + side)
                fancy = (3 * here + beside + tl.where(first_column, 8, 7)) >> 4
            else:                                 # h2v1: columns 3:1, over 4
                fancy = (3 * here + beside + tl.where(first_column, 1, 2)) >> 2
            if plane == 0:
                cb, cb_block = fancy, block
            else:
                cr, cr_block = fancy, block
        pixel = images + n.to(tl.int64) * image_stride + y * row_stride + x
        target = out + n.to(tl.int64) * image_stride + y * row_stride + x
        for channel in tl.static_range(3):        # jdcolor.c's fixed point, 16 bits
            if channel == 0:
                change = (((91881 * (cr - 128) + 32768) >> 16)
                          - ((91881 * (cr_block - 128) + 32768) >> 16))
            elif channel == 1:
                change = (((-22554 * (cb - 128) + 32768 - 46802 * (cr - 128)) >> 16)
                          - ((-22554 * (cb_block - 128) + 32768 - 46802 * (cr_block - 128)) >> 16))
            else:
                change = (((116130 * (cb - 128) + 32768) >> 16)
                          - ((116130 * (cb_block - 128) + 32768) >> 16))
            value = tl.load(pixel + channel * channel_stride, mask=inside, other=0).to(tl.int32)
            fixed = tl.minimum(tl.maximum(value + change, 0), 255).to(tl.uint8)
            tl.store(target + channel * channel_stride, fixed, mask=inside)


def block_samples(images: torch.Tensor, factors: tuple[int, int]) -> torch.Tensor:
    """chroma_upsampling.block_samples's result for `uint8[N, 3, H, W]` images and `factors`
    H2V2 or H2V1, by the first kernel: `int32[N, 2, ceil(H / v), ceil(W / 2)]`."""
    require()
    batch = images.contiguous()
    count, _, height, width = batch.shape
    vertical = factors[1]
    block_rows, block_cols = -(-height // vertical), -(-width // 2)
    samples = torch.empty((count, 2, block_rows, block_cols), dtype=torch.int32, device=batch.device)
    blocks = block_rows * block_cols
    block = elementwise_block(batch.device, blocks)
    launchable(_block_samples_kernel, batch.device)[(triton.cdiv(blocks, block), count)](
        batch, samples, height, width, block_rows, block_cols,
        batch.stride(0), batch.stride(1), batch.stride(2),
        V=vertical, BLOCK_SIZE=block, **no_fp_fusion(batch.device))
    return samples


def interpolated_chroma(images: torch.Tensor, factors: tuple[int, int]) -> torch.Tensor:
    """chroma_upsampling.interpolated_chroma's result for `uint8[N, 3, H, W]` images with
    repeated chroma (`factors` H2V2 or H2V1; other factors: the images themselves), in two
    kernels. The input is not modified."""
    if factors not in (H2V2, H2V1):
        return images
    batch = images.contiguous()
    samples = block_samples(batch, factors)
    count, _, height, width = batch.shape
    _, _, block_rows, block_cols = samples.shape
    out = torch.empty_like(batch)
    block = elementwise_block(batch.device, height * width)
    launchable(_chroma_fix_kernel, batch.device)[(triton.cdiv(height * width, block), count)](
        batch, samples, out, height, width, block_rows, block_cols,
        batch.stride(0), batch.stride(1), batch.stride(2),
        V=factors[1], BLOCK_SIZE=block)
    return out


def warm_up(device: torch.device) -> None:
    """Compile the kernels of both subsamplings on `device` (one each for every photo size:
    SIZE_ARGUMENTS), so that no request waits for Triton's compiler."""
    images = torch.zeros((1, 3, 6, 10), dtype=torch.uint8, device=device)
    for factors in (H2V2, H2V1):
        interpolated_chroma(images, factors)
