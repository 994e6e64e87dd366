"""The JPEG header read from its markers alone (handlers.request.image_header.plain_jpeg_header)
gives what Pillow's reading gives (`pillow_header`), or leaves the file to Pillow: over JPEGs of
every kind Pillow writes (baseline, progressive, optimized, 4:4:4 / 4:2:2 / 4:2:0, grey, CMYK,
comments, EXIF orientation, ICC profiles, restart markers), the corrupted corpus of tests/gpu
(the file cut at 26 places, bytes changed in its scan), and seeded changes, insertions, deletions
and cuts in the header bytes, `read_header` routes and refuses every file as Pillow's reading
does: the same ImageHeader, or the same error."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from handlers.ground.errors import ClientError
from handlers.request import image_header
from handlers.request.image_header import pillow_header, plain_jpeg_header, read_header
from tests.images import corrupted_jpegs, encode, exif_with_orientation, textured_rgb
from torchserve_vision.lab.benchmark_images import distinct_jpegs
from torchserve_vision.photo_sets import jpeg, project_photos


def outcome(read, data: bytes) -> object:
    try:
        return read(data)
    except ClientError as error:
        return (error.status, error.error_type, error.message)


def kinds_of_jpeg() -> list[bytes]:
    photo = project_photos()[0].image
    icc = Image.new("RGB", (8, 8)).info.get("icc_profile") or bytes(range(256)) * 3
    return [
        jpeg(photo, 90), jpeg(photo, 40),
        encode(photo, "JPEG", progressive=True), encode(photo, "JPEG", optimize=True),
        encode(photo, "JPEG", subsampling=0), encode(photo, "JPEG", subsampling=1),
        encode(photo.convert("L"), "JPEG"), encode(photo.convert("CMYK"), "JPEG"),
        encode(photo, "JPEG", comment=b"a comment"), encode(photo, "JPEG", icc_profile=icc),
        encode(photo, "JPEG", restart_marker_blocks=4),
        encode(textured_rgb(90, 140, seed=3), "JPEG", exif=exif_with_orientation(6)),
        encode(textured_rgb(1, 1, seed=4), "JPEG"),
        *distinct_jpegs(8),
    ]


def header_mutations(data: bytes, count: int, seed: int) -> list[bytes]:
    """Seeded changes in the bytes before the first scan: a byte replaced, inserted or deleted,
    or the file cut there."""
    scan = data.index(b"\xff\xda")
    rng = np.random.default_rng(seed)
    mutated = []
    for _ in range(count):
        body = bytearray(data)
        position = int(rng.integers(2, scan + 4))
        action = int(rng.integers(0, 4))
        if action == 0:
            body[position] = int(rng.integers(0, 256))
        elif action == 1:
            body.insert(position, int(rng.integers(0, 256)))
        elif action == 2:
            del body[position]
        else:
            del body[position:]
        mutated.append(bytes(body))
    return mutated


def test_plain_jpegs_are_read_from_their_markers_as_pillow_reads_them():
    plain = [data for data in kinds_of_jpeg() if plain_jpeg_header(data) is not None]
    assert len(plain) >= 12                      # the fast reading is the usual one
    for data in kinds_of_jpeg():
        assert outcome(read_header, data) == outcome(pillow_header, data)
    oriented = encode(textured_rgb(90, 140, seed=3), "JPEG", exif=exif_with_orientation(6))
    assert plain_jpeg_header(oriented) is None and read_header(oriented).orientation == 6


@pytest.mark.parametrize("source", range(3))
def test_corrupted_and_mutated_jpegs_are_routed_and_refused_as_pillow_reads_them(source):
    data = kinds_of_jpeg()[source * 2]
    corpus = corrupted_jpegs(data) + header_mutations(data, 400, seed=source)
    fast = 0
    for index, mutated in enumerate(corpus):
        assert outcome(read_header, mutated) == outcome(pillow_header, mutated), index
        fast += plain_jpeg_header(mutated) is not None
    assert fast > len(corpus) // 4                # most are still read from their markers


def test_a_size_pillow_warns_about_is_left_to_pillow(monkeypatch):
    data = jpeg(project_photos()[0].image, 90)
    width, height = Image.open(io.BytesIO(data)).size
    monkeypatch.setattr(image_header.Image, "MAX_IMAGE_PIXELS", width * height - 1)
    assert plain_jpeg_header(data) is None
    monkeypatch.setattr(image_header.Image, "MAX_IMAGE_PIXELS", width * height)
    assert plain_jpeg_header(data) is not None
