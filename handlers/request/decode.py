"""Decode a batch's encoded images into 8-bit RGB tensors in display orientation, each image's
fault its own ClientError.

Accepted: JPEG (and MPO, the multi-picture JPEG phones write), PNG, WebP, BMP, GIF (first
frame) and TIFF (first page). EXIF orientation is applied; grayscale, palette, RGBA, CMYK and
16-bit images become 8-bit RGB.

Every image's header is read first and its limits checked (handlers.request.image_header), so
nothing over a limit is decoded. Then, by what the header says:

- a JPEG whose short side is at least twice what the model needs, when the archive decodes
  JPEGs at reduced scale (`jpeg_draft`): Pillow, at 1/2, 1/4 or 1/8 scale in the DCT domain, on
  the CPU whatever the worker's device, so an archive gives the same pixels on every device;
- the other JPEGs that nvJPEG takes (8-bit Huffman-coded baseline, extended or progressive,
  grey or YCbCr, complete: `JpegCoding.device_decodable`): all of the batch together,
  `torchvision.io.decode_jpeg` on a list on the worker's device (nvJPEG on a GPU, libjpeg-turbo
  on the CPU; on a GPU, nvImageCodec's decoder where the archive says `jpeg_decoder:
  nvimgcodec`), in calls bounded by `limits.max_decode_pixels_per_call`
  (handlers.request.jpeg_batches), then oriented on the device (handlers.request.orientation).
  Where that decoder repeats 4:2:0 or 4:2:2 chroma over its blocks (nvJPEG; measured once per
  device, `decoder_repeats_chroma`), the chroma is first interpolated as libjpeg-turbo does
  (handlers.request.chroma_upsampling).
  A progressive JPEG takes nvJPEG's slower path, with its entropy decoding on the host, in the
  same call. An image the batched decoder refuses, alone too, goes to the CPU path below, whose
  answer or error is the CPU's for the same bytes;
- everything else (CMYK, arithmetic-coded or 12-bit JPEGs, truncated ones, PNG, WebP, BMP, GIF,
  TIFF): one image at a time on the CPU, JPEG and still WebP by `torchvision.io` (libjpeg-turbo,
  libwebp), the rest by Pillow (PNG too: see `uses_torchvision`).

Images decoded on the CPU for a CUDA worker are copied to it from pinned memory, asynchronously.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2.functional import to_dtype

from handlers.ground.errors import ClientError
from handlers.ground.limits import ImageLimits
from handlers.ground.profiler_ranges import profiled_range
from handlers.request import chroma_kernels, chroma_upsampling
from handlers.request.image_header import (
    ACCEPTED_FORMATS,
    ImageHeader,
    checked_header,
    read_header,
)
from handlers.request.jpeg_batches import JpegDecoder, byte_tensors, decode_jpeg_run, pixel_bounded_chunks
from handlers.request.orientation import oriented

__all__ = ["DecodeResult", "decode_image_bytes", "decode_images", "decode_with_headers", "read_header",
           "warm_up_decoder"]

CPU = torch.device("cpu")
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")

# One image's outcome: `uint8[3, H, W]` RGB in display orientation, or why it was refused.
DecodeResult = torch.Tensor | ClientError


def uses_torchvision(header: ImageHeader) -> bool:
    """torchvision.io decodes these formats correctly and faster than Pillow.

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


def decode_with_torchvision(data: bytes, header: ImageHeader) -> torch.Tensor:
    """One JPEG or still WebP on the CPU, in display orientation (a JPEG's from its header, as
    the batched path applies it)."""
    (encoded,) = byte_tensors([data])
    try:
        image = decode_image(encoded, mode=ImageReadMode.RGB, apply_exif_orientation=False)
    except RuntimeError as error:
        raise ClientError(
            400, "UndecodableImage", f"the {header.image_format} image could not be decoded: {error}"
        ) from None
    return oriented(_to_uint8_rgb(image), header.orientation)


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
    # dimensions") from a TIFF whose later frame lacks its size tags, struct.error from a GIF
    # whose later frame header is cut short (both found by the property tests).
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError,
            struct.error) as error:
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


def decode_alone(data: bytes, header: ImageHeader, limits: ImageLimits) -> torch.Tensor:
    """One image on the CPU: torchvision.io where it decodes the format, else Pillow."""
    if uses_torchvision(header):
        return decode_with_torchvision(data, header)
    return decode_with_pillow(data, header, limits)


def decodes_reduced(header: ImageHeader, min_short_side: int | None) -> bool:
    return bool(min_short_side and header.image_format == "JPEG"
                and min(header.width, header.height) >= 2 * min_short_side)


def _on_device(image: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda" or image.device == device:
        return image
    return image.pin_memory().to(device, non_blocking=True)


def _decode_on_cpu(data: bytes, header: ImageHeader, limits: ImageLimits,
                   min_short_side: int | None) -> DecodeResult:
    try:
        if decodes_reduced(header, min_short_side):
            assert min_short_side is not None
            return decode_jpeg_reduced(data, header, limits, min_short_side)
        return decode_alone(data, header, limits)
    except ClientError as error:
        return error


def decode_images(encoded: Sequence[bytes], limits: ImageLimits, device: torch.device | None = None,
                  min_short_side: int | None = None, decoder: JpegDecoder = "torchvision"
                  ) -> list[DecodeResult]:
    """Each encoded image -> `uint8[3, H, W]` RGB in display orientation on `device` (the CPU
    when None), or its ClientError: 400 for an empty, unreadable, unsupported or too-small
    image, 413 for a body over `limits.max_body_bytes` or an image over `limits.max_pixels`
    (from the header, before decoding). With `min_short_side`, a JPEG at least twice that size
    may come back reduced, its short side still >= `min_short_side` (see the module docstring).
    One result per input, in order; a fault of one image is never another's."""
    return [result for result, _ in decode_with_headers(encoded, limits, device, min_short_side, decoder)]


def decode_with_headers(encoded: Sequence[bytes], limits: ImageLimits, device: torch.device | None = None,
                        min_short_side: int | None = None, decoder: JpegDecoder = "torchvision",
                        use_chroma_kernels: bool = False) -> list[tuple[DecodeResult, ImageHeader | None]]:
    """`decode_images`, each result with the header it was decoded by (None where the header
    itself was refused): what a later stage reads of the image (its format and stored size)
    without reading the header again. `decoder` is a CUDA device's batched JPEG decoder (a CPU
    decodes with torchvision's libjpeg-turbo whatever it says); with `use_chroma_kernels`, chroma
    it repeats is interpolated by handlers.request.chroma_kernels (the same pixels, fewer
    kernels) instead of tensor operations."""
    device = device or CPU
    results: list[DecodeResult | None] = [None] * len(encoded)
    headers: list[ImageHeader | None] = [None] * len(encoded)
    on_device: dict[int, ImageHeader] = {}
    for index, data in enumerate(encoded):
        try:
            header = headers[index] = checked_header(data, limits)
        except ClientError as error:
            results[index] = error
            continue
        jpeg = header.jpeg
        if jpeg is not None and jpeg.device_decodable and not decodes_reduced(header, min_short_side):
            on_device[index] = header
        else:
            results[index] = _decode_on_cpu(data, header, limits, min_short_side)
    _decode_batched(encoded, on_device, limits, device, results, batched_decoder(device, decoder),
                    use_chroma_kernels)
    return [(result if isinstance(result, ClientError) else _on_device(result, device), header)
            for result, header in zip(_settled(results), headers, strict=True)]


def batched_decoder(device: torch.device, decoder: JpegDecoder) -> JpegDecoder:
    """The batched JPEG decoder a worker on `device` uses when its archive asks for `decoder`."""
    return decoder if device.type == "cuda" else "torchvision"


def _decode_batched(encoded: Sequence[bytes], headers: dict[int, ImageHeader], limits: ImageLimits,
                    device: torch.device, results: list[DecodeResult | None], decoder: JpegDecoder,
                    use_chroma_kernels: bool = False) -> None:
    """The batch's device-decodable JPEGs (`headers`, by index) into `results`, in calls bounded
    by the limit's pixels; one the decoder refuses goes to the CPU path."""
    indices = list(headers)
    pixels = [headers[index].pixels for index in indices]
    for run in pixel_bounded_chunks(pixels, limits.max_decode_pixels_per_call):
        chosen = [indices[position] for position in run]
        with profiled_range("decode:jpeg_call"):     # ranges for lab gpu's profile
            decoded = decode_jpeg_run([encoded[index] for index in chosen], device, decoder)
        if decoder_repeats_chroma(device, decoder):
            with profiled_range("decode:chroma"):
                decoded = _as_libjpeg_upsamples(decoded, [headers[index] for index in chosen],
                                                 use_chroma_kernels)
        for index, image in zip(chosen, decoded, strict=True):
            header = headers[index]
            results[index] = (oriented(image, header.orientation) if image is not None
                              else _decode_on_cpu(encoded[index], header, limits, None))


# Per device and decoder: does that batched decoder repeat subsampled chroma (see chroma_upsampling)?
_REPEATS_CHROMA: dict[tuple[torch.device, JpegDecoder], bool] = {}


def decoder_repeats_chroma(device: torch.device, decoder: JpegDecoder = "torchvision") -> bool:
    """Whether the batched JPEG decoder `decoder` on `device` repeats subsampled chroma where the
    CPU's libjpeg-turbo interpolates it (nvJPEG does), measured once per device and decoder on a
    probe JPEG. The CPU's decoder is libjpeg-turbo itself: False without measuring."""
    if device.type == "cpu":
        return False
    if (device, decoder) not in _REPEATS_CHROMA:
        probe = chroma_upsampling.probe_jpeg()
        reference = decode_with_torchvision(probe, read_header(probe))
        _REPEATS_CHROMA[device, decoder] = chroma_upsampling.replicates_chroma(
            lambda data: _decoded_alone(data, device, decoder), reference)
    return _REPEATS_CHROMA[device, decoder]


def _decoded_alone(data: bytes, device: torch.device, decoder: JpegDecoder) -> torch.Tensor:
    image = decode_jpeg_run([data], device, decoder)[0]
    if image is None:
        raise AssertionError("the batched decoder refused the chroma probe JPEG")
    return image


def _as_libjpeg_upsamples(images: list[torch.Tensor | None], headers: list[ImageHeader],
                          kernels: bool = False) -> list[torch.Tensor | None]:
    """Stored pixels from a batched decoder that repeats subsampled chroma, with that chroma
    interpolated as the CPU's decoder does: images of one size and subsampling in one pass (by
    Triton kernels with `kernels`, by tensor operations without)."""
    interpolate = chroma_kernels.interpolated_chroma if kernels else chroma_upsampling.interpolated_chroma
    groups: dict[tuple[tuple[int, ...], tuple[int, int]], list[tuple[int, torch.Tensor]]] = {}
    for position, (image, header) in enumerate(zip(images, headers, strict=True)):
        factors = header.jpeg.chroma_factors if header.jpeg is not None else (1, 1)
        if image is not None and factors in chroma_upsampling.INTERPOLATED:
            groups.setdefault((tuple(image.shape), factors), []).append((position, image))
    interpolated = list(images)
    for (_, factors), members in groups.items():
        fixed = interpolate(torch.stack([image for _, image in members]), factors)
        for (position, _), image in zip(members, fixed, strict=True):
            interpolated[position] = image
    return interpolated


def _settled(results: list[DecodeResult | None]) -> list[DecodeResult]:
    if any(result is None for result in results):
        raise AssertionError("an image of the batch was neither decoded nor refused")
    return [result for result in results if result is not None]


def decode_image_bytes(data: bytes, limits: ImageLimits, device: torch.device | None = None,
                       min_short_side: int | None = None) -> torch.Tensor:
    """One image through `decode_images`: its tensor, or its ClientError raised."""
    result = decode_images([data], limits, device, min_short_side)[0]
    if isinstance(result, ClientError):
        raise result
    return result


def warm_up_decoder(limits: ImageLimits, device: torch.device | None = None,
                    decoder: JpegDecoder = "torchvision") -> bool:
    """Decode a small JPEG as a batch would, on `device`, so that the first request does not pay
    the decoder's one-time start (on CUDA, torchvision creates its nvJPEG decoder on first use),
    and measure whether that decoder repeats subsampled chroma (`decoder_repeats_chroma`, returned)."""
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (120, 90, 60)).save(buffer, "JPEG", quality=90)
    result = decode_images([buffer.getvalue()] * 2, limits, device, decoder=decoder)[0]
    if isinstance(result, ClientError):
        raise AssertionError(f"the decoder refused its warm-up JPEG: {result.message}")
    device = device or CPU
    return decoder_repeats_chroma(device, batched_decoder(device, decoder))
