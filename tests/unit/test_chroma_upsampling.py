"""Subsampled chroma interpolated as libjpeg does after a decoder that repeats it
(handlers/request/chroma_upsampling.py, its place in handlers/request/decode.py).

nvJPEG's chroma is reproduced on the CPU by libjpeg-turbo itself with its chroma repeated
(TurboJPEG's TJFLAG_FASTUPSAMPLE, tests/libjpeg_turbo.py); the reference is the same library's
default, the CPU decoder's pixels."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from handlers.request import decode as decode_module
from handlers.request.chroma_upsampling import (
    H2V1,
    H2V2,
    fancy_upsampled,
    interpolated_chroma,
    probe_jpeg,
    replicates_chroma,
)
from handlers.request.decode import decode_with_headers, decoder_repeats_chroma
from handlers.request.image_header import read_jpeg_coding
from tests import libjpeg_turbo
from torchserve_vision.lab.device_answers import agreement, answer_check_images, ranked_answers
from torchserve_vision.local_handler import load_handler
from torchserve_vision.photo_sets import project_photos

PILLOW_SUBSAMPLING = {H2V2: 2, H2V1: 1}      # Pillow's `subsampling`: 4:2:0, 4:2:2


def photo_jpeg(image: Image.Image, subsampling: int, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality, subsampling=subsampling)
    return buffer.getvalue()


def mean_error(image: torch.Tensor, reference: torch.Tensor) -> float:
    return (image.int() - reference.int()).abs().float().mean().item()


@pytest.mark.parametrize("subsampling", [0, 1, 2])
def test_the_header_gives_how_many_pixels_share_a_chroma_sample(subsampling):
    coding = read_jpeg_coding(photo_jpeg(Image.new("RGB", (33, 17), (10, 200, 30)), subsampling))
    assert coding is not None
    assert coding.chroma_factors == {0: (1, 1), 1: H2V1, 2: H2V2}[subsampling]


def test_grey_and_unusual_chroma_sampling_are_not_interpolated():
    grey = read_jpeg_coding(photo_jpeg(Image.new("L", (33, 17), 90), 0))
    assert grey is not None and grey.chroma_factors == (1, 1)
    data = bytearray(photo_jpeg(Image.new("RGB", (32, 32), (10, 200, 30)), 2))
    frame = data.index(b"\xff\xc0")
    assert data[frame + 10 + 3 + 1] == 0x11           # Cb's factors, after Y's three bytes
    data[frame + 10 + 3 + 1] = 0x21                   # Cb 2x1 while Cr stays 1x1
    coding = read_jpeg_coding(bytes(data))
    assert coding is not None and coding.chroma_factors == (0, 0)
    image = torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8)
    assert interpolated_chroma(image, (0, 0)) is image and interpolated_chroma(image, (1, 1)) is image


def test_fancy_upsampling_weighs_and_rounds_as_libjpeg():
    """jdsample.c by hand: h2v1 columns (3a + b + 1) >> 2 and (3a + b + 2) >> 2, edges kept;
    h2v2 rows 3:1 first, then columns (3a + b + 8) >> 4 and (3a + b + 7) >> 4."""
    samples = torch.tensor([[0, 160]], dtype=torch.int32)
    assert fancy_upsampled(samples, H2V1, 1, 4).tolist() == [[0, 40, 120, 160]]
    square = torch.tensor([[0, 160], [80, 240]], dtype=torch.int32)
    # column sums for output row 0: 3*row0 + row0 = [0, 640]; row 1: 3*row0 + row1 = [80, 720]
    assert fancy_upsampled(square, H2V2, 2, 4).tolist() == [[0, 40, 120, 160], [20, 60, 140, 180]]
    assert fancy_upsampled(square, H2V2, 3, 3).shape == (3, 3)     # cut to an odd image size


@pytest.mark.parametrize("factors", [H2V2, H2V1], ids=["4:2:0", "4:2:2"])
def test_repeated_chroma_interpolated_comes_to_libjpegs_pixels(factors):
    """On the project's photos: what remains is the rounding of each block's estimated sample
    and channels the repeating decoder clamped (measured on the Zen 4: mean error 0.19-0.96 ->
    0.001-0.05, values more than 2 levels off 0.7-11 % -> 0-0.25 %)."""
    for photo in project_photos():
        data = photo_jpeg(photo.image, PILLOW_SUBSAMPLING[factors])
        reference = libjpeg_turbo.decode(data, repeat_chroma=False)
        repeated = libjpeg_turbo.decode(data, repeat_chroma=True)
        fixed = interpolated_chroma(repeated, factors)
        assert fixed.dtype == torch.uint8 and fixed.shape == reference.shape
        before, after = mean_error(repeated, reference), mean_error(fixed, reference)
        assert after * 10 < before, (photo.name, before, after)
        far = ((fixed.int() - reference.int()).abs() > 2).float().mean().item()
        assert far < 0.005, (photo.name, far)


def test_a_decoder_is_told_to_repeat_chroma_by_the_probe():
    reference = libjpeg_turbo.decode(probe_jpeg(), repeat_chroma=False)
    assert replicates_chroma(lambda data: libjpeg_turbo.decode(data, repeat_chroma=True), reference)
    assert not replicates_chroma(lambda data: libjpeg_turbo.decode(data, repeat_chroma=False), reference)
    assert not decoder_repeats_chroma(torch.device("cpu"))        # the CPU's decoder is libjpeg


def use_libjpeg_as_batched_decoder(monkeypatch: pytest.MonkeyPatch, repeat_chroma: bool,
                                   said_to_repeat: bool) -> None:
    """The batched decoder replaced by libjpeg-turbo, repeating chroma as nvJPEG does or not, and
    said to repeat it or not (what a GPU worker measures at start)."""
    monkeypatch.setattr(decode_module, "decode_jpeg_run",
                        lambda encoded, device, decoder: [libjpeg_turbo.decode(bytes(data), repeat_chroma)
                                                          for data in encoded])
    monkeypatch.setattr(decode_module, "decoder_repeats_chroma", lambda device, decoder: said_to_repeat)


@pytest.fixture
def repeating_decoder(monkeypatch):
    """As a GPU worker's nvJPEG: chroma repeated, and said to be."""
    use_libjpeg_as_batched_decoder(monkeypatch, repeat_chroma=True, said_to_repeat=True)


def test_the_batched_path_interpolates_before_turning_the_image(repeating_decoder):
    """A 4:2:0 photo twice (one pass for the two) and stored turned (EXIF 6 and 8) comes out
    upright with the CPU decoder's pixels: the chroma blocks are those of the stored image."""
    from handlers.ground.limits import ImageLimits
    from torchserve_vision.lab.device_answers import turned_jpeg

    photo = project_photos()[0].image
    upright = photo_jpeg(photo, 2)
    turns = {6: -1, 8: 1}                   # EXIF orientation -> quarter turns shown (rot90's k)
    turned = [turned_jpeg(photo, orientation) for orientation in turns]
    results = []
    for result, _ in decode_with_headers([upright, upright, *turned], ImageLimits()):
        assert isinstance(result, torch.Tensor), result
        results.append(result)
    reference = libjpeg_turbo.decode(upright, repeat_chroma=False)
    assert mean_error(results[0], reference) < 0.1 and torch.equal(results[0], results[1])
    for data, quarter_turns, result in zip(turned, turns.values(), results[2:], strict=True):
        shown = torch.rot90(libjpeg_turbo.decode(data, repeat_chroma=False), quarter_turns, (-2, -1))
        assert result.shape == shown.shape and mean_error(result, shown) < 0.1


def test_repeated_chroma_interpolated_answers_as_the_cpu(classifier, monkeypatch):
    """The default classifier at fp32 on the answer-check images (the photos, their variants,
    turned photos): decoded as nvJPEG decodes, its answers moved by up to 0.034 on the H200 and
    0.034 here; interpolated, within 0.02 of the CPU's and no best class changed."""
    images = answer_check_images()
    names = [image.name for image in images]

    def answers(repeat_chroma: bool, interpolate: bool) -> list:
        use_libjpeg_as_batched_decoder(monkeypatch, repeat_chroma, said_to_repeat=interpolate)
        handler = load_handler(classifier.model_dir, 16, None, {"precision": "fp32", "jpeg_draft": False})
        return ranked_answers(handler, images)

    reference = answers(repeat_chroma=False, interpolate=False)
    repeated = agreement("fp32", names, answers(repeat_chroma=True, interpolate=False), reference, "cpu")
    interpolated = agreement("fp32", names, answers(repeat_chroma=True, interpolate=True), reference, "cpu")
    assert repeated.max_change > 0.02                      # what the interpolation has to remove
    assert interpolated.max_change < 0.02, (interpolated.worst_image, interpolated.max_change)
    assert interpolated.top1_changes == 0
