from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps

from handlers.ground.errors import ClientError
from handlers.ground.limits import ImageLimits
from handlers.request import decode
from handlers.request.decode import decode_image_bytes
from handlers.request.image_header import read_header
from tests.images import encode, exif_with_orientation, photo_bytes, png_declaring_size, textured_rgb

LIMITS = ImageLimits()
RGB = textured_rgb(48, 64, seed=1)


def as_array(image: torch.Tensor) -> np.ndarray:
    assert image.dtype == torch.uint8 and image.ndim == 3 and image.shape[0] == 3
    return image.permute(1, 2, 0).numpy().astype(int)


def pillow_rgb(data: bytes) -> np.ndarray:
    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")).astype(int)


@pytest.mark.parametrize(
    ("image_format", "options", "tolerance"),
    [
        ("PNG", {}, 0),
        ("BMP", {}, 0),
        ("TIFF", {}, 0),
        ("WEBP", {"lossless": True}, 0),
        ("GIF", {}, 0),
        ("JPEG", {"quality": 95}, 0),
    ],
)
def test_each_format_decodes_to_the_same_pixels_as_pillow(image_format, options, tolerance):
    data = encode(RGB if image_format != "GIF" else RGB.convert("P"), image_format, **options)
    decoded = as_array(decode_image_bytes(data, LIMITS))
    assert decoded.shape == (48, 64, 3)
    assert np.abs(decoded - pillow_rgb(data)).max() <= tolerance


@pytest.mark.parametrize(
    ("mode", "image_format"),
    [("L", "PNG"), ("L", "JPEG"), ("P", "PNG"), ("RGBA", "PNG"), ("LA", "PNG"), ("RGBA", "WEBP"),
     ("CMYK", "JPEG"), ("CMYK", "TIFF"), ("L", "TIFF"), ("1", "BMP")],
)
def test_other_colour_modes_become_8_bit_rgb(mode, image_format):
    data = encode(RGB.convert(mode), image_format)
    decoded = as_array(decode_image_bytes(data, LIMITS))
    assert decoded.shape == (48, 64, 3)
    # CMYK JPEG: libjpeg-turbo and Pillow convert the Adobe-inverted channels the same way.
    assert np.abs(decoded - pillow_rgb(data)).mean() < 1.0


@pytest.mark.parametrize("image_format", ["PNG", "TIFF"])
def test_16_bit_grayscale_is_scaled_not_clipped_to_8_bits(image_format):
    values = np.linspace(0, 65535, 48 * 64).reshape(48, 64).astype(np.uint16)
    data = encode(Image.fromarray(values), image_format)
    decoded = as_array(decode_image_bytes(data, LIMITS))
    expected = (values.astype(int) // 257)[..., None].repeat(3, axis=2)
    assert np.abs(decoded - expected).max() <= 1
    assert decoded.max() == 255 and decoded.min() == 0


@pytest.mark.parametrize("image_format", ["JPEG", "PNG", "WEBP", "TIFF"])
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(image_format, orientation):
    options: dict[str, object] = {"exif": exif_with_orientation(orientation)}
    if image_format == "WEBP":
        options["lossless"] = True
    if image_format == "JPEG":
        options["quality"] = 95
    data = encode(RGB, image_format, **options)
    decoded = as_array(decode_image_bytes(data, LIMITS))
    expected = pillow_rgb(data)
    assert decoded.shape == expected.shape
    assert decoded.shape[:2] == ((64, 48) if orientation in (6, 8) else (48, 64))
    assert np.abs(decoded - expected).mean() < 1.0


def test_animated_gif_gives_its_first_frame():
    first, second = RGB.convert("P"), RGB.transpose(Image.Transpose.FLIP_LEFT_RIGHT).convert("P")
    data = encode(first, "GIF", save_all=True, append_images=[second])
    decoded = as_array(decode_image_bytes(data, LIMITS))
    assert np.array_equal(decoded, np.asarray(first.convert("RGB")).astype(int))


def test_animated_webp_gives_its_first_frame():
    second = RGB.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    data = encode(RGB, "WEBP", save_all=True, append_images=[second], lossless=True)
    decoded = as_array(decode_image_bytes(data, LIMITS))
    assert np.array_equal(decoded, np.asarray(RGB).astype(int))


def test_real_photos_decode_at_their_size():
    assert decode_image_bytes(photo_bytes("chelsea.png"), LIMITS).shape == (3, 300, 451)
    assert decode_image_bytes(photo_bytes("rocket.jpg"), LIMITS).shape == (3, 427, 640)


def expect_client_error(data: bytes, status: int, error_type: str,
                        limits: ImageLimits = LIMITS) -> ClientError:
    with pytest.raises(ClientError) as caught:
        decode_image_bytes(data, limits)
    assert (caught.value.status, caught.value.error_type) == (status, error_type)
    return caught.value


def test_empty_body_is_a_400():
    expect_client_error(b"", 400, "EmptyBody")


def test_random_bytes_are_a_400():
    expect_client_error(np.random.default_rng(0).bytes(5000), 400, "UndecodableImage")


def test_text_is_a_400_that_says_it_is_text():
    error = expect_client_error(b"this is not an image\n", 400, "NotAnImage")
    assert "text" in error.message


@pytest.mark.parametrize("image_format", ["JPEG", "PNG", "WEBP", "GIF", "TIFF", "BMP"])
def test_truncated_images_are_a_400(image_format):
    data = encode(textured_rgb(200, 300, seed=2), image_format)
    with pytest.raises(ClientError) as caught:
        decode_image_bytes(data[: len(data) // 2], LIMITS)
    assert caught.value.status == 400


def test_an_unsupported_format_is_named():
    error = expect_client_error(encode(RGB, "ICO"), 400, "UnsupportedFormat")
    assert "ICO" in error.message


def test_body_over_the_byte_limit_is_a_413():
    data = encode(RGB, "PNG")
    expect_client_error(data, 413, "BodyTooLarge", ImageLimits(max_body_bytes=len(data) - 1))


def test_decompression_bomb_is_refused_from_its_header_without_decoding(monkeypatch):
    def must_not_decode(*args, **kwargs):
        raise AssertionError("the pixels of an over-limit image must not be decoded")

    monkeypatch.setattr(decode, "decode_with_torchvision", must_not_decode)
    monkeypatch.setattr(decode, "decode_with_pillow", must_not_decode)
    bomb = png_declaring_size(60_000, 60_000)
    assert len(bomb) < 2000
    error = expect_client_error(bomb, 413, "ImageTooLarge")
    assert "3600000000" in error.message


def test_pixel_limit_is_configurable():
    data = encode(RGB, "JPEG")
    expect_client_error(data, 413, "ImageTooLarge", ImageLimits(max_pixels=48 * 64 - 1))
    assert decode_image_bytes(data, ImageLimits(max_pixels=48 * 64)).shape == (3, 48, 64)


def test_minimum_side_is_enforced():
    expect_client_error(encode(textured_rgb(1, 1), "PNG"), 400, "ImageTooSmall",
                        ImageLimits(min_side_px=8))


def test_header_reports_stored_size_and_webp_orientation():
    header = read_header(encode(RGB, "WEBP", exif=exif_with_orientation(6)))
    assert (header.image_format, header.width, header.height, header.orientation) == ("WEBP", 64, 48, 6)
    assert read_header(encode(RGB, "JPEG")).image_format == "JPEG"


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "GIF", "TIFF", "BMP", "WEBP"])
def test_reading_the_header_decodes_no_pixels(image_format, monkeypatch):
    def no_loading(self):
        raise AssertionError("read_header must not decode pixels")

    data = encode(RGB, image_format)
    monkeypatch.setattr(Image.Image, "load", no_loading)
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_loading)
    header = read_header(data)
    assert (header.width, header.height) == (64, 48)


def test_a_bomb_under_pillows_own_limit_is_still_refused_by_ours():
    error = expect_client_error(png_declaring_size(8000, 6000), 413, "ImageTooLarge")
    assert "48000000" in error.message


def test_an_animation_over_the_frame_limit_is_a_413_before_decoding():
    frames = [RGB.rotate(angle).convert("P") for angle in range(0, 60, 10)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    expect_client_error(data, 413, "TooManyFrames", ImageLimits(max_frames=5))
    assert decode_image_bytes(data, ImageLimits(max_frames=6)).shape == (3, 48, 64)


def test_a_large_jpeg_is_decoded_at_reduced_scale_when_the_model_needs_less():
    big = textured_rgb(1200, 1600, seed=4)
    data = encode(big, "JPEG", quality=95)
    reduced = decode_image_bytes(data, LIMITS, min_short_side=256)
    assert reduced.shape == (3, 300, 400)  # 1/4 scale: the smallest with a short side >= 256
    full = decode_image_bytes(data, LIMITS)
    from torchvision.transforms.v2 import functional as F

    expected = F.resize(full, [300], antialias=True).float()
    assert (reduced.float() - expected).abs().mean() < 3.0


def test_reduced_jpeg_decoding_still_applies_exif_orientation():
    data = encode(textured_rgb(1200, 1600, seed=5), "JPEG", exif=exif_with_orientation(6))
    assert decode_image_bytes(data, LIMITS, min_short_side=256).shape == (3, 400, 300)


def test_small_jpegs_and_other_formats_are_decoded_in_full():
    assert decode_image_bytes(encode(RGB, "JPEG"), LIMITS, min_short_side=256).shape == (3, 48, 64)
    png = encode(textured_rgb(1200, 1600), "PNG", compress_level=1)
    assert decode_image_bytes(png, LIMITS, min_short_side=256).shape == (3, 1200, 1600)
