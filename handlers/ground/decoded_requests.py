"""A request as parsed (its encoded images and options) and as decoded (an image tensor and its
options): what every stage of a batch hands on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

Options = TypeVar("Options")


@dataclass(frozen=True)
class ParsedRequest(Generic[Options]):
    """A request's encoded images and its options (one frozen dataclass per model kind).
    `several`: it asked for several images (KServe v1 `instances`, a v2 input of shape [n]), so
    its answer is a list, one entry per image, even when it sent one."""

    images: tuple[bytes, ...]
    options: Options
    several: bool = False


@dataclass(frozen=True)
class DecodedImage(Generic[Options]):
    """A decoded request: its image (`uint8[3, H, W]`, display orientation, on the worker's
    device) and its options."""

    image: torch.Tensor
    options: Options
