"""Deterministic test images and their encodings; real photos from scikit-image's wheel."""

from __future__ import annotations

import io
import struct
import zlib
from functools import cache
from pathlib import Path

import numpy as np
import skimage
import torch
from PIL import Image

from handlers.ground.errors import ClientError

PHOTOS_DIR = Path(skimage.__file__).parent / "data"
CAT_LABELS = {"tabby", "tiger cat", "Egyptian cat"}


def photo_bytes(name: str) -> bytes:
    return (PHOTOS_DIR / name).read_bytes()


@cache
def load_photo(name: str = "chelsea.png") -> bytes:
    """What the tests that keep a server under load for a while send: one of the project's
    photos (chelsea.png unless `name` says another) re-encoded as a quality-90 JPEG (chelsea 35
    KB instead of 240; its three best classes stay the three cats). A request of it costs about
    5 ms of a core less than one of the PNG (the Zen 4 EPYC, a Lite0 server: the worker's PNG
    decode and the copies of the bytes through the frontend and the worker's protocol), over
    the thousands such loads send in a run."""
    with Image.open(PHOTOS_DIR / name) as photo:
        return encode(photo.convert("RGB"), "JPEG", quality=90)


def textured_rgb(height: int, width: int, seed: int = 0) -> Image.Image:
    """A smooth gradient plus mild noise: compresses like a photo, differs per seed."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / max(width - 1, 1), ys * 255 / max(height - 1, 1),
                     (xs + ys) * 127 / max(width + height - 2, 1)], axis=-1)
    noisy = base + rng.normal(0, 8, size=base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def encode(image: Image.Image, image_format: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, image_format, **options)
    return buffer.getvalue()


def exif_with_orientation(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def png_declaring_size(width: int, height: int) -> bytes:
    """A few hundred bytes of PNG whose header declares width x height RGB pixels (a bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def jpeg_with_broken_huffman_table(jpeg: bytes) -> bytes:
    """The JPEG with its first Huffman table's code counts overwritten (they then sum past 256):
    its header still reads, and libjpeg refuses it ("Bogus Huffman table definition") when
    decoding, as a batched decode call does for the whole call."""
    table = jpeg.index(b"\xff\xc4")
    broken = bytearray(jpeg)
    broken[table + 5:table + 21] = b"\xff" * 16
    return bytes(broken)


def corrupted_jpegs(data: bytes) -> list[bytes]:
    """A JPEG cut at 26 places (headers, scan, just before the end) and 24 seeded copies with four
    bytes changed in its scan: what the hardware decoder might take where libjpeg refuses."""
    cuts = [len(data) * k // 25 for k in range(1, 25)] + [len(data) - 2, len(data) - 1]
    rng = np.random.default_rng(0)
    changed = []
    for _ in range(24):
        body = bytearray(data)
        for position in rng.integers(700, len(data) - 2, 4):
            body[position] = int(rng.integers(0, 256))
        changed.append(bytes(body))
    return [data[:cut] for cut in cuts] + changed


def decoded(result: object) -> torch.Tensor:
    """A decode outcome that must be an image (handlers.request.decode.DecodeResult)."""
    assert isinstance(result, torch.Tensor), result
    return result


def refused(result: object) -> ClientError:
    """A decode outcome that must be a refusal."""
    assert isinstance(result, ClientError), result
    return result


@cache
def slow_png(width: int = 3000, height: int = 2000) -> bytes:
    """A PNG of a gradient, 6 MP by default: about 20 KB to send, but a full decode (PNG has no
    reduced-scale one, unlike a JPEG) and a resize from 6 MP to compute, about 100 ms of a core.
    A queue builds behind a worker busy with a few of them however slowly the client sends;
    with large JPEGs, on a loaded machine, the worker could take them as fast as they arrived."""
    gradient = np.linspace(0, 255, width, dtype=np.uint8)[None, :, None].repeat(height, 0).repeat(3, 2)
    encoded = io.BytesIO()
    Image.fromarray(gradient).save(encoded, "PNG")
    return encoded.getvalue()


def bad_payloads() -> dict[str, tuple[bytes, str, int]]:
    """The bad inputs every model must refuse alone: name -> (body, content type, expected status)."""
    jpeg = photo_bytes("rocket.jpg")
    frames = [Image.new("RGB", (16, 12), (i, 255 - i, i * 7 % 256)) for i in range(101)]  # all distinct
    return {
        "empty": (b"", "image/jpeg", 400),
        "random bytes": (np.random.default_rng(7).bytes(20_000), "application/octet-stream", 400),
        "truncated jpeg": (jpeg[: len(jpeg) // 2], "image/jpeg", 400),
        "text": (b"GET me a cat picture, please", "image/png", 400),
        "json without an image": (b'{"data": "aGVsbG8gd29ybGQ="}', "application/json", 400),
        "json without data": (b'{"image": 42}', "application/json", 400),
        "decompression bomb": (png_declaring_size(50_000, 50_000), "image/png", 413),
        "too many frames": (encode(frames[0], "GIF", save_all=True, append_images=frames[1:]),
                            "image/gif", 413),
    }
