"""The limits a request is checked against before any pixel is decoded, and the error of an
invalid setting."""

from __future__ import annotations

from dataclasses import dataclass

# TorchServe's own default max_request_size; keep the two consistent.
DEFAULT_MAX_BODY_BYTES = 6_553_500
DEFAULT_MAX_PIXELS = 40_000_000
DEFAULT_MAX_FRAMES = 100
DEFAULT_MAX_IMAGES_PER_REQUEST = 16
# 128 MP of RGB: 384 MB of decoded pixels per call (64 photos of 2 MP, or 3 of 40 MP).
DEFAULT_MAX_DECODE_PIXELS_PER_CALL = 128_000_000


class SettingsError(ValueError):
    """The archive's handler settings are invalid."""


@dataclass(frozen=True)
class ImageLimits:
    """Limits checked per request, all before any pixel is decoded. Only the first frame of an
    animated image is decoded; `max_frames` bounds how many frames it may declare.
    `max_images_per_request` bounds a request that carries several images (KServe v1
    `instances`, a v2 input of shape [n]); more is a 413 for that request.
    `max_decode_pixels_per_call` bounds the pixels of the JPEGs a batch decodes in one call
    (3 bytes each on the device; an image over it is decoded alone)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    min_side_px: int = 1
    max_frames: int = DEFAULT_MAX_FRAMES
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    max_decode_pixels_per_call: int = DEFAULT_MAX_DECODE_PIXELS_PER_CALL
