"""Decode one request's bytes into an 8-bit RGB image tensor, or raise a ClientError.

Accepted: JPEG (and MPO, the multi-picture JPEG phones write), PNG, WebP, BMP, GIF (first
frame) and TIFF (first page). EXIF orientation is applied; grayscale, palette, RGBA, CMYK and
16-bit images become 8-bit RGB.

JPEG and still WebP are decoded by `torchvision.io` (libjpeg-turbo, libwebp; JPEG on the worker's
GPU with nvJPEG when it has one); the rest by Pillow (PNG too: see `uses_torchvision`). Before
anything is decoded, Pillow reads only the header so the pixel limit is enforced at no cost (a
decompression bomb of a few kilobytes declaring a gigapixel is refused before any pixel is
allocated).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import (  # the plugins of every accepted format, so Image.open(formats=...) knows them
    BmpImagePlugin,  # noqa: F401
    GifImagePlugin,  # noqa: F401
    Image,
    ImageOps,
    JpegImagePlugin,  # noqa: F401
    PngImagePlugin,  # noqa: F401
    TiffImagePlugin,  # noqa: F401
    UnidentifiedImageError,
    WebPImagePlugin,  # noqa: F401
)
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from torchvision.transforms.v2.functional import to_dtype

from handlers.errors import ClientError
from handlers.model.settings import ImageLimits

# Pillow opens MPO files through its JPEG plugin and reports format "MPO".
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
ACCEPTED_NAMES = "JPEG, PNG, WebP, BMP, GIF or TIFF"
EXIF_ORIENTATION_TAG = 0x0112
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


@dataclass(frozen=True)
class ImageHeader:
    """What Pillow reads from the header alone: format and stored size; for WebP also the EXIF
    orientation and whether it is animated (the two facts that decide who decodes it)."""

    image_format: str
    width: int
    height: int
    orientation: int = 1
    animated: bool = False


def _describe_unreadable(data: bytes) -> ClientError:
    """Say why bytes that no accepted decoder could read were refused."""
    try:
        other = Image.open(io.BytesIO(data))
        if other.format not in (*ACCEPTED_FORMATS, "MPO"):
            return ClientError(400, "UnsupportedFormat",
                               f"{other.format} images are not accepted; send {ACCEPTED_NAMES}")
    except Exception:  # noqa: BLE001 - any failure here only means "not an image we know"
        pass
    head = data[:512]
    try:
        looks_like_text = all(ch.isprintable() or ch.isspace() for ch in head.decode("utf-8"))
    except UnicodeDecodeError:
        looks_like_text = False
    if looks_like_text:
        return ClientError(400, "NotAnImage", f"the body is text, not an image; send {ACCEPTED_NAMES}")
    return ClientError(400, "UndecodableImage", f"the body is not a readable {ACCEPTED_NAMES} image")


def read_header(data: bytes) -> ImageHeader:
    """Read format and size without decoding pixels; ClientError if unreadable.

    Nothing here may load pixel data (Pillow's PNG `getexif`, for one, decodes the whole image),
    so that the pixel limit is checked before any decoding work.
    """
    try:
        image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
        width, height = image.size
        if image.format != "WEBP":
            return ImageHeader("JPEG" if image.format == "MPO" else str(image.format), width, height)
        orientation = int(image.getexif().get(EXIF_ORIENTATION_TAG, 1))
        return ImageHeader("WEBP", width, height, orientation, bool(getattr(image, "is_animated", False)))
    except Image.DecompressionBombError as error:
        raise ClientError(413, "ImageTooLarge", str(error)) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, KeyError, TypeError):
        raise _describe_unreadable(data) from None


def check_pixel_limits(header: ImageHeader, limits: ImageLimits) -> None:
    if header.width * header.height > limits.max_pixels:
        raise ClientError(
            413,
            "ImageTooLarge",
            f"the image is {header.width}x{header.height} = {header.width * header.height} pixels; "
            f"the limit is {limits.max_pixels}",
        )
    if min(header.width, header.height) < limits.min_side_px:
        raise ClientError(
            400,
            "ImageTooSmall",
            f"the image is {header.width}x{header.height}; each side must be at least "
            f"{limits.min_side_px} pixels",
        )


def check_body_size(data: bytes, limits: ImageLimits) -> None:
    if not data:
        raise ClientError(400, "EmptyBody", "the request body is empty")
    if len(data) > limits.max_body_bytes:
        raise ClientError(
            413,
            "BodyTooLarge",
            f"the body is {len(data)} bytes; the limit is {limits.max_body_bytes}",
        )


def uses_torchvision(header: ImageHeader) -> bool:
    """torchvision.io decodes these formats correctly (orientation included) and faster.

    Not PNG: torchvision 0.29.1's decode_png crashes the process (SIGSEGV after
    "libpng error: IDAT: incorrect data check") on some corrupted files, found by the property
    tests; Pillow raises an error for the same bytes.
    """
    if header.image_format == "JPEG":
        return True
    # torchvision ignores WebP EXIF orientation and refuses animated WebP.
    return header.image_format == "WEBP" and not header.animated and header.orientation == 1


def _to_uint8_rgb(image: torch.Tensor) -> torch.Tensor:
    if image.dtype != torch.uint8:
        image = to_dtype(image, torch.uint8, scale=True)
    return image


def decode_with_torchvision(data: bytes, header: ImageHeader, device: torch.device) -> torch.Tensor:
    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if header.image_format == "JPEG" and device.type == "cuda":
        try:
            return decode_jpeg(
                encoded, mode=ImageReadMode.RGB, apply_exif_orientation=True, device=device
            )
        except RuntimeError:
            pass  # nvJPEG refuses some valid files (e.g. CMYK); libjpeg-turbo below does not
    try:
        image = decode_image(encoded, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError as error:
        raise ClientError(
            400, "UndecodableImage", f"the {header.image_format} image could not be decoded: {error}"
        ) from None
    return _to_uint8_rgb(image)


def _pillow_to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in SIXTEEN_BIT_MODES:
        # Pillow clips (not scales) 16-bit values when converting to 8 bits; scale first.
        image = image.convert("I").point(lambda value: value * (1 / 256)).convert("L")
    return image.convert("RGB")


def check_frame_count(image: Image.Image, limits: ImageLimits) -> None:
    frames = int(getattr(image, "n_frames", 1))  # counted from frame headers, nothing decoded
    if frames > limits.max_frames:
        raise ClientError(413, "TooManyFrames",
                          f"the image has {frames} frames; the limit is {limits.max_frames} "
                          "(only the first is used)")


def decode_with_pillow(data: bytes, header: ImageHeader, limits: ImageLimits,
                       draft_size_wh: tuple[int, int] | None = None) -> torch.Tensor:
    """Pillow's decode of the first frame, EXIF-oriented, as `uint8[3, H, W]` RGB. With
    `draft_size_wh` a JPEG is decoded at the smallest 1/2, 1/4 or 1/8 scale still covering it."""
    try:
        image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
        check_frame_count(image, limits)
        image.seek(0)  # first frame of GIF / animated WebP, first page of TIFF
        if draft_size_wh is not None:
            image.draft("RGB", draft_size_wh)
        rgb = _pillow_to_rgb(ImageOps.exif_transpose(image))
    # Pillow's plugins raise more than OSError on corrupted files: e.g. TypeError("Missing
    # dimensions") from a TIFF whose later frame lacks its size tags (found by the property tests).
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError) as error:
        raise ClientError(
            400, "UndecodableImage", f"the {header.image_format} image could not be decoded: {error}"
        ) from None
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).contiguous()


def decode_jpeg_reduced(data: bytes, header: ImageHeader, limits: ImageLimits,
                        min_short_side: int) -> torch.Tensor:
    """Decode a large JPEG at 1/2, 1/4 or 1/8 scale in the DCT domain (Pillow's draft mode), the
    smallest scale whose short side is still >= `min_short_side`. Much cheaper than a full decode
    followed by a downscale (figures in docs/benchmarks.md, "reduced-scale JPEG decode")."""
    scale = min_short_side / min(header.width, header.height)
    draft_size = (math.ceil(header.width * scale), math.ceil(header.height * scale))
    return decode_with_pillow(data, header, limits, draft_size)


def decode_image_bytes(
    data: bytes, limits: ImageLimits, device: torch.device | None = None,
    min_short_side: int | None = None,
) -> torch.Tensor:
    """Decode encoded image bytes into `uint8[3, H, W]` RGB in display orientation.

    The tensor is on `device` when it is a CUDA device and the image is a JPEG (decoded by nvJPEG),
    on the CPU otherwise. With `min_short_side`, a CPU decode of a JPEG at least twice that size
    may return a reduced image whose short side is still >= `min_short_side` (for a model that
    resizes to that size anyway). Raises ClientError: 400 for empty, unreadable, unsupported or too-small
    images, 413 for a body over `limits.max_body_bytes` or an image over `limits.max_pixels`
    (checked from the header, before decoding).
    """
    check_body_size(data, limits)
    header = read_header(data)
    check_pixel_limits(header, limits)
    on_cpu = device is None or device.type != "cuda"
    if (on_cpu and min_short_side and header.image_format == "JPEG"
            and min(header.width, header.height) >= 2 * min_short_side):
        return decode_jpeg_reduced(data, header, limits, min_short_side)
    if uses_torchvision(header):
        return decode_with_torchvision(data, header, device or torch.device("cpu"))
    return decode_with_pillow(data, header, limits)
