"""The batch's JPEGs decoded together, every fault traced to its own image, and the same answer
for each image as when it is decoded alone (handlers.request.decode, jpeg_batches, image_header).
Runs on the CPU, where `decode_jpeg` takes a list too; tests/gpu/ runs the same on a GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from handlers.ground.errors import ClientError
from handlers.ground.limits import ImageLimits
from handlers.request import jpeg_batches
from handlers.request.decode import decode_image_bytes, decode_images, warm_up_decoder
from handlers.request.image_header import read_header, read_jpeg_coding
from handlers.request.jpeg_batches import pixel_bounded_chunks
from tests.images import (
    decoded,
    encode,
    exif_with_orientation,
    jpeg_with_broken_huffman_table,
    photo_bytes,
    refused,
    textured_rgb,
)

LIMITS = ImageLimits(max_pixels=4_000_000)
CPU = torch.device("cpu")


def mixed_batch() -> dict[str, bytes]:
    """Good JPEGs of several sizes and codings among every kind of bad or CPU-only image."""
    good = encode(textured_rgb(60, 80, seed=1), "JPEG", quality=90)
    return {
        "baseline": good,
        "other_size": encode(textured_rgb(90, 70, seed=2), "JPEG", quality=80),
        "progressive": encode(textured_rgb(60, 80, seed=3), "JPEG", progressive=True),
        "rotated": encode(textured_rgb(60, 80, seed=4), "JPEG", exif=exif_with_orientation(6)),
        "grey": encode(textured_rgb(50, 50, seed=5).convert("L"), "JPEG"),
        "cmyk": encode(textured_rgb(40, 56, seed=6).convert("CMYK"), "JPEG"),
        "truncated": good[: len(good) * 3 // 4],
        "broken_huffman": jpeg_with_broken_huffman_table(good),
        "png": encode(textured_rgb(30, 40, seed=7), "PNG"),
        "empty": b"",
        "text": b"not an image at all\n",
        "photo": photo_bytes("rocket.jpg"),
        "too_large": encode(textured_rgb(2100, 2000, seed=8), "JPEG", quality=20),
    }


def same_outcome(got: torch.Tensor | ClientError, expected: torch.Tensor | ClientError) -> bool:
    if isinstance(expected, ClientError):
        return isinstance(got, ClientError) and (got.status, got.error_type, got.message) == (
            expected.status, expected.error_type, expected.message)
    return isinstance(got, torch.Tensor) and torch.equal(got, expected)


def alone(data: bytes, limits: ImageLimits = LIMITS) -> torch.Tensor | ClientError:
    try:
        return decode_image_bytes(data, limits)
    except ClientError as error:
        return error


def test_every_image_of_a_mixed_batch_gets_what_it_gets_alone():
    batch = mixed_batch()
    results = decode_images(list(batch.values()), LIMITS, CPU)
    assert len(results) == len(batch)
    for (name, data), result in zip(batch.items(), results, strict=True):
        assert same_outcome(result, alone(data)), name
    outcome = dict(zip(batch, results, strict=True))
    assert {name for name, result in outcome.items() if isinstance(result, ClientError)} == {
        "truncated", "broken_huffman", "empty", "text", "too_large"}
    assert refused(outcome["too_large"]).status == 413
    assert decoded(outcome["rotated"]).shape == (3, 80, 60)


@pytest.fixture
def decode_calls(monkeypatch) -> list[int]:
    """The size of every batched decode call made, in order (the real calls are made)."""
    calls: list[int] = []
    real_call = jpeg_batches._decode_call

    def counting_call(encoded, device, decoder):
        calls.append(len(encoded))
        return real_call(encoded, device, decoder)

    monkeypatch.setattr(jpeg_batches, "_decode_call", counting_call)
    return calls


def test_a_failed_batched_call_is_retried_image_by_image_and_only_the_bad_one_fails(decode_calls):
    good = [encode(textured_rgb(40, 50, seed=seed), "JPEG") for seed in range(3)]
    bad = jpeg_with_broken_huffman_table(good[0])
    results = decode_images([good[0], bad, good[1], good[2]], LIMITS, CPU)
    assert decode_calls == [4, 1, 1, 1, 1]
    assert [isinstance(result, ClientError) for result in results] == [False, True, False, False]
    assert refused(results[1]).status == 400 and "Huffman" in refused(results[1]).message
    for data, result in zip(good, [results[0], results[2], results[3]], strict=True):
        assert torch.equal(decoded(result), decode_image_bytes(data, LIMITS))


def test_the_decoded_pixels_of_one_call_are_bounded(decode_calls):
    images = [encode(textured_rgb(40, 50, seed=seed), "JPEG") for seed in range(5)]
    bounded = ImageLimits(max_pixels=4_000_000, max_decode_pixels_per_call=2 * 40 * 50)
    results = decode_images(images, bounded, CPU)
    assert decode_calls == [2, 2, 1]
    assert all(torch.equal(decoded(result), decode_image_bytes(data, LIMITS))
               for data, result in zip(images, results, strict=True))


@given(st.lists(st.integers(min_value=1, max_value=100), max_size=30), st.integers(1, 150))
def test_chunks_take_every_image_once_in_order_within_the_bound(pixels, bound):
    chunks = list(pixel_bounded_chunks(pixels, bound))
    assert [index for chunk in chunks for index in chunk] == list(range(len(pixels)))
    for chunk in chunks:
        assert len(chunk) == 1 or sum(pixels[index] for index in chunk) <= bound


def test_a_large_jpeg_keeps_its_reduced_scale_decode_in_a_batch():
    big = encode(textured_rgb(1200, 1600, seed=9), "JPEG", quality=90)
    small = encode(textured_rgb(60, 80, seed=10), "JPEG")
    results = decode_images([big, small], LIMITS, CPU, min_short_side=256)
    assert decoded(results[0]).shape == (3, 300, 400) and decoded(results[1]).shape == (3, 60, 80)
    assert torch.equal(decoded(results[0]), decode_image_bytes(big, LIMITS, min_short_side=256))


@pytest.mark.parametrize(("name", "decodable"), [
    ("baseline", True), ("progressive", True), ("grey", True), ("cmyk", False), ("truncated", False)])
def test_the_header_says_which_jpegs_the_device_decoder_takes(name, decodable):
    data = mixed_batch()[name]
    coding = read_jpeg_coding(data)
    assert coding is not None and coding.device_decodable is decodable
    assert coding.progressive is (name == "progressive")


def test_an_arithmetic_coded_frame_is_left_to_the_cpu():
    data = bytearray(encode(textured_rgb(20, 20, seed=11), "JPEG"))
    frame = data.index(b"\xff\xc0")
    data[frame + 1] = 0xC9          # SOF9: extended sequential, arithmetic-coded
    coding = read_jpeg_coding(bytes(data))
    assert coding is not None and coding.frame == 0xC9 and not coding.device_decodable


def test_a_jpeg_with_a_marker_libjpeg_does_not_know_is_left_to_the_cpu_and_gets_its_refusal():
    # nvJPEG decoded such a file where libjpeg refuses it (seen on an H200): the header walk
    # finds the marker, and the CPU decoder gives the CPU's 400 on every device.
    data = encode(textured_rgb(60, 80, seed=12), "JPEG", quality=90)
    scan = read_jpeg_coding(data)
    assert scan is not None and scan.device_decodable and scan.plain_markers
    middle = (scan.scan_offset + len(data)) // 2
    marked = data[:middle] + b"\xff\x1a" + data[middle:]
    coding = read_jpeg_coding(marked)
    assert coding is not None and coding.ends and not coding.plain_markers
    assert not coding.device_decodable
    error = refused(decode_images([marked], LIMITS, CPU)[0])
    assert (error.status, error.error_type) == (400, "UndecodableImage")
    assert "Unsupported marker type 0x1a" in error.message


def test_the_segments_between_a_progressive_jpegs_scans_are_stepped_over():
    data = encode(textured_rgb(64, 96, seed=13), "JPEG", progressive=True)
    assert data.count(b"\xff\xda") > 2                  # several scans, tables between them
    coding = read_jpeg_coding(data)
    assert coding is not None and coding.ends and coding.plain_markers and coding.device_decodable
    cut = read_jpeg_coding(data[:-2])                    # no end-of-image marker
    assert cut is not None and not cut.ends and not cut.device_decodable


def test_the_header_reads_a_jpegs_orientation():
    header = read_header(encode(textured_rgb(20, 30), "JPEG", exif=exif_with_orientation(8)))
    assert (header.orientation, header.width, header.height) == (8, 30, 20)


def test_out_of_device_memory_a_run_is_decoded_in_halves_and_a_single_image_is_a_server_fault(monkeypatch):
    calls: list[int] = []
    real_call = jpeg_batches._decode_call

    def short_of_memory(encoded, device, decoder):
        calls.append(len(encoded))
        if len(encoded) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_call(encoded, device, decoder)

    monkeypatch.setattr(jpeg_batches, "_decode_call", short_of_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    images = [encode(textured_rgb(40, 50, seed=seed), "JPEG") for seed in range(5)]
    results = decode_images(images, LIMITS, CPU)
    assert calls == [5, 2, 3, 1, 2]
    assert all(torch.equal(decoded(result), decode_image_bytes(data, LIMITS))
               for data, result in zip(images, results, strict=True))
    monkeypatch.setattr(jpeg_batches, "_decode_call", lambda encoded, device, decoder: (_ for _ in ()).throw(
        torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        decode_images(images[:1], LIMITS, CPU)


def test_the_decoder_warm_up_decodes_a_batch_through_the_batched_call(decode_calls):
    warm_up_decoder(LIMITS, CPU)
    assert decode_calls == [2]
