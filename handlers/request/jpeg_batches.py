"""The JPEGs of a batch decoded in as few calls as their pixels allow, each failure traced to its
own image: `torchvision.io.decode_jpeg` on a list (nvJPEG on a CUDA device, libjpeg-turbo on the
CPU), or nvImageCodec's decoder where the archive asks for it (handlers.request.nvimgcodec_decoder),
stored pixels (orientation is the caller's: handlers.request.orientation).

A batched call returns no partial results: when it raises, every image of the call is decoded
alone, and only those that fail alone are reported failed (None), for the caller to decode on
the CPU, which gives the CPU's answer or error for the same bytes.

On CUDA two faults of the decoder are guarded against by draining the caller's stream on the
host before each call: torchvision allocates the outputs while the caller's stream is current
but writes them from a stream of its own without waiting on it, so a block freed on the caller's
stream with kernels still queued may be overwritten under them (pytorch/vision PR #9606); and
nvJPEG's hardware engine writes when the call is made, whatever stream it is given
(meta-pytorch/torchcodec PR #1634: a device-side wait does not order it, a host wait does).
torchvision keeps one decoder per process behind a lock and synchronises the host at the end of
each call, so a worker decodes one call at a time; that is its own batch's decode.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from handlers.request import nvimgcodec_decoder

# The batched decoder of a CUDA worker (an archive's `jpeg_decoder`): torchvision's nvJPEG, or
# nvImageCodec's (handlers.request.nvimgcodec_decoder), whose hardware backend uses the GPU's
# JPEG engines where it has them.
JpegDecoder = Literal["torchvision", "nvimgcodec"]
JPEG_DECODERS: tuple[JpegDecoder, ...] = ("torchvision", "nvimgcodec")


def pixel_bounded_chunks(pixels: Sequence[int], max_pixels: int) -> Iterator[list[int]]:
    """Consecutive index runs of `pixels` whose sums stay within `max_pixels` (an image over the
    bound alone in its run). Every index appears exactly once, in order."""
    run: list[int] = []
    total = 0
    for index, count in enumerate(pixels):
        if run and total + count > max_pixels:
            yield run
            run, total = [], 0
        run.append(index)
        total += count
    if run:
        yield run


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def byte_tensors(encoded: Sequence[bytes]) -> list[torch.Tensor]:
    """`uint8[N]` tensors over the encoded images' own memory, no copy: the decoders only read
    them. (torch warns that a `bytes` object is not writable; nothing writes to these.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return [torch.frombuffer(data, dtype=torch.uint8) for data in encoded]


def _decode_call(encoded: Sequence[bytes], device: torch.device,
                 decoder: JpegDecoder) -> list[torch.Tensor | None]:
    if decoder == "nvimgcodec":
        return nvimgcodec_decoder.decode_call(encoded, device)
    _drain(device)
    tensors = byte_tensors(encoded)
    decoded = decode_jpeg(tensors, mode=ImageReadMode.RGB, apply_exif_orientation=False,
                          device=device)
    return list(decoded)


def decode_jpeg_run(encoded: Sequence[bytes], device: torch.device,
                    decoder: JpegDecoder = "torchvision") -> list[torch.Tensor | None]:
    """`uint8[3, H, W]` stored pixels on `device` per JPEG, one call of `decoder` for the run;
    None for an image the decoder refuses even alone. Out of device memory, the run is decoded
    in halves, down to single images (one that still does not fit is a server fault, raised)."""
    if not encoded:
        return []
    try:
        return _decode_call(encoded, device, decoder)
    except torch.cuda.OutOfMemoryError:
        if len(encoded) == 1:
            raise
        out_of_memory = True
    except RuntimeError:
        if len(encoded) == 1:
            return [None]
        out_of_memory = False
    # Retried outside the except blocks, so the failed call's buffers are already released.
    if out_of_memory:
        torch.cuda.empty_cache()
        half = len(encoded) // 2
        return (decode_jpeg_run(encoded[:half], device, decoder)
                + decode_jpeg_run(encoded[half:], device, decoder))
    return [decode_jpeg_run([data], device, decoder)[0] for data in encoded]
