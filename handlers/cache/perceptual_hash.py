"""A perceptual hash of a decoded image (pHash), for the response cache's opt-in near-duplicate
mode: frames that were re-encoded or rescaled get the same 64 bits.

The image's luma, resized (antialiased) to 32 x 32, goes through a 2-D DCT-II; the 8 x 8 lowest
frequencies are compared with their median, one bit each. This is the construction of the
`imagehash` package's `phash`, computed on the tensor the handler already has (no second decode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch
from torchvision.transforms.v2 import functional as F

HASH_SIZE = 8
SAMPLE_SIZE = 32


@lru_cache(maxsize=1)
def dct_matrix(size: int = SAMPLE_SIZE) -> torch.Tensor:
    """`float[size, size]` DCT-II basis (unnormalised): row k is cos(pi (2n + 1) k / 2 size)."""
    n = torch.arange(size, dtype=torch.float64)
    return torch.cos(math.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * size))


def perceptual_hash(image: torch.Tensor) -> bytes:
    """`uint8[3, H, W]` (or `[1, H, W]`) -> 8 bytes. The input is not modified."""
    return perceptual_hashes([image])[0]


def perceptual_hashes(images: Sequence[torch.Tensor]) -> list[bytes]:
    """`perceptual_hash` of each image, in order: the 32 x 32 samples are made on the images'
    device and read from it in one copy (on a GPU one synchronisation for the batch), the DCT and
    the median on the CPU in float64, as for one image."""
    if not images:
        return []
    samples = torch.stack([_luma_sample(image) for image in images]).cpu()
    return [_hash_of_sample(sample) for sample in samples]


def _luma_sample(image: torch.Tensor) -> torch.Tensor:
    grey = image.float() if image.shape[0] == 1 else F.rgb_to_grayscale(image.float())
    return F.resize(grey, [SAMPLE_SIZE, SAMPLE_SIZE], antialias=True)[0].double()


def _hash_of_sample(small: torch.Tensor) -> bytes:
    basis = dct_matrix()
    low = (basis @ small @ basis.T)[:HASH_SIZE, :HASH_SIZE].flatten()
    bits = (low > low.quantile(0.5)).tolist()  # numpy's median: the middle two averaged
    return int("".join("1" if bit else "0" for bit in bits), 2).to_bytes(8, "big")


def hamming_distance(first: bytes, second: bytes) -> int:
    return bin(int.from_bytes(first, "big") ^ int.from_bytes(second, "big")).count("1")
