"""nvImageCodec as a CUDA worker's batched JPEG decoder (`jpeg_decoder: nvimgcodec`,
handlers.request.nvimgcodec_decoder), run here on its libjpeg-turbo backend: the same pixels as
torchvision's decode, in the layout the later stages take, and the same outcome for every image
of a mixed batch as the default decoder gives it. tests/gpu runs it on a GPU's JPEG engines."""

from __future__ import annotations

import pytest
import torch

from handlers.ground.limits import SettingsError
from handlers.model.settings import parse_classifier_settings, parse_detector_settings
from handlers.request import decode, jpeg_batches, nvimgcodec_decoder
from handlers.request.decode import decode_images
from handlers.task.transforms import stacked
from tests.images import encode, photo_bytes, textured_rgb
from tests.unit.test_jpeg_batches import LIMITS, mixed_batch, same_outcome

CPU = torch.device("cpu")


def torchvision_decodes(jpegs: list[bytes]) -> list[torch.Tensor | None]:
    return jpeg_batches.decode_jpeg_run(jpegs, CPU, "torchvision")


@pytest.mark.parametrize("subsampling", [0, 1, 2])      # 4:4:4, 4:2:2, 4:2:0
def test_its_pixels_are_torchvisions_bit_for_bit_as_channels_first_views(subsampling):
    jpegs = [encode(textured_rgb(61 + seed, 47, seed=seed), "JPEG", quality=90, subsampling=subsampling)
             for seed in range(3)] + [photo_bytes("rocket.jpg")]
    got = jpeg_batches.decode_jpeg_run(jpegs, CPU, "nvimgcodec")
    for image, expected in zip(got, torchvision_decodes(jpegs), strict=True):
        assert image is not None and expected is not None
        assert image.dtype == torch.uint8 and image.shape == expected.shape
        assert torch.equal(image, expected)
        assert image.permute(1, 2, 0).is_contiguous()        # the decoder's [H, W, 3] buffer
    same_size = [image for image in got[:1] * 2 if image is not None]
    assert stacked(same_size).is_contiguous(memory_format=torch.channels_last)


def test_a_grey_jpeg_comes_out_as_three_equal_channels():
    grey = encode(textured_rgb(40, 30, seed=9).convert("L"), "JPEG")
    (image,) = jpeg_batches.decode_jpeg_run([grey], CPU, "nvimgcodec")
    (expected,) = torchvision_decodes([grey])
    assert image is not None and expected is not None and image.shape == (3, 40, 30)
    assert torch.equal(image, expected)


def test_a_jpeg_it_cannot_read_is_none_and_its_batch_mates_are_decoded():
    good = encode(textured_rgb(60, 80, seed=1), "JPEG", quality=90)
    got = jpeg_batches.decode_jpeg_run([good, b"\xff\xd8 not a scan", good], CPU, "nvimgcodec")
    assert got[1] is None
    assert got[0] is not None and got[2] is not None and torch.equal(got[0], got[2])


def test_every_image_of_a_mixed_batch_gets_what_the_default_decoder_gives_it(monkeypatch):
    """As a CUDA worker with `jpeg_decoder: nvimgcodec` decodes (its choice of decoder kept on
    the CPU here): refusals, orientation, CPU-only formats and sizes as with torchvision."""
    batch = mixed_batch()
    expected = decode_images(list(batch.values()), LIMITS, CPU)
    monkeypatch.setattr(decode, "batched_decoder", lambda device, decoder: decoder)
    called: list[int] = []
    real_call = nvimgcodec_decoder.decode_call

    def counted_call(encoded: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
        called.append(len(encoded))
        return real_call(encoded, device)

    monkeypatch.setattr(nvimgcodec_decoder, "decode_call", counted_call)
    got = decode_images(list(batch.values()), LIMITS, CPU, decoder="nvimgcodec")
    assert called, "nvImageCodec was not called"
    for (name, _), result, reference in zip(batch.items(), got, expected, strict=True):
        assert same_outcome(result, reference), name


def test_a_cpu_worker_decodes_with_torchvision_whatever_the_archive_asks():
    assert decode.batched_decoder(CPU, "nvimgcodec") == "torchvision"
    assert decode.batched_decoder(torch.device("cuda", 0), "nvimgcodec") == "nvimgcodec"
    assert decode.batched_decoder(torch.device("cuda", 0), "torchvision") == "torchvision"


def test_the_archive_names_its_decoder(monkeypatch):
    classifier = {"model": {"source": "timm", "architecture": "resnet18"}}
    assert parse_classifier_settings(classifier).jpeg_decoder == "torchvision"
    chosen = parse_classifier_settings({**classifier, "jpeg_decoder": "nvimgcodec"})
    assert chosen.jpeg_decoder == "nvimgcodec"
    detector = {"model": {"source": "torchvision", "architecture": "ssdlite320_mobilenet_v3_large"},
                "jpeg_decoder": "nvimgcodec"}
    assert parse_detector_settings(detector).jpeg_decoder == "nvimgcodec"
    with pytest.raises(SettingsError, match="jpeg_decoder"):
        parse_classifier_settings({**classifier, "jpeg_decoder": "pillow"})
    monkeypatch.setattr(nvimgcodec_decoder, "available", lambda: False)
    with pytest.raises(SettingsError, match="nvidia-nvimgcodec-cu13"):
        parse_classifier_settings({**classifier, "jpeg_decoder": "nvimgcodec"})
