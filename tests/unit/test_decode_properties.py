"""Property tests: whatever bytes or JSON arrive, decoding raises only ClientError, and quickly."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from handlers.ground.errors import ClientError
from handlers.ground.limits import ImageLimits
from handlers.request.decode import decode_image_bytes
from handlers.request.request_body import extract_image_bytes
from tests.images import encode, exif_with_orientation, textured_rgb

LIMITS = ImageLimits(max_pixels=4_000_000)
PROPERTY_SETTINGS = settings(max_examples=150, deadline=2000,
                             suppress_health_check=[HealthCheck.too_slow])


def _samples() -> dict[str, bytes]:
    image = textured_rgb(40, 56, seed=3)
    return {
        "jpeg": encode(image, "JPEG", exif=exif_with_orientation(6)),
        "png": encode(image, "PNG"),
        "png16": encode(image.convert("I;16"), "PNG"),
        "webp": encode(image, "WEBP"),
        "webp_animated": encode(image, "WEBP", save_all=True, append_images=[image.rotate(90)]),
        "gif": encode(image.convert("P"), "GIF", save_all=True, append_images=[image.convert("P")]),
        "bmp": encode(image, "BMP"),
        "tiff": encode(image.convert("CMYK"), "TIFF"),
    }


SAMPLES = _samples()


def decode_or_client_error(data: bytes) -> None:
    try:
        image = decode_image_bytes(data, LIMITS)
    except ClientError as error:
        assert 400 <= error.status < 500 and error.message
        return
    assert image.ndim == 3 and image.shape[0] == 3


@PROPERTY_SETTINGS
@given(st.binary(max_size=4096))
def test_random_bytes(data):
    decode_or_client_error(data)


@PROPERTY_SETTINGS
@given(st.sampled_from(sorted(SAMPLES)), st.data())
def test_truncated_images_of_every_format(name, data):
    sample = SAMPLES[name]
    decode_or_client_error(sample[: data.draw(st.integers(0, len(sample) - 1))])


@PROPERTY_SETTINGS
@given(st.sampled_from(sorted(SAMPLES)), st.data())
def test_corrupted_images_of_every_format(name, data):
    corrupted = bytearray(SAMPLES[name])
    for _ in range(data.draw(st.integers(1, 12))):
        position = data.draw(st.integers(0, len(corrupted) - 1))
        corrupted[position] = data.draw(st.integers(0, 255))
    decode_or_client_error(bytes(corrupted))


@PROPERTY_SETTINGS
@given(st.sampled_from(sorted(SAMPLES)), st.binary(min_size=1, max_size=64), st.data())
def test_images_with_bytes_spliced_in(name, junk, data):
    sample = SAMPLES[name]
    position = data.draw(st.integers(0, len(sample)))
    decode_or_client_error(sample[:position] + junk + sample[position:])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children,
                                                                      max_size=4),
    max_leaves=12)


@PROPERTY_SETTINGS
@given(JSON_VALUES)
def test_random_json_bodies(body):
    try:
        decode_or_client_error(extract_image_bytes({"body": body}))
    except ClientError as error:
        assert error.status == 400


@PROPERTY_SETTINGS
@given(st.dictionaries(st.sampled_from(["data", "image", "x", "body"]),
                       JSON_VALUES | st.binary(max_size=64), max_size=3))
def test_random_form_rows(row):
    try:
        decode_or_client_error(extract_image_bytes(json.loads(json.dumps(row, default=repr))
                                                   if not any(isinstance(v, bytes) for v in row.values())
                                                   else {k: bytearray(v) if isinstance(v, bytes) else v
                                                         for k, v in row.items()}))
    except ClientError as error:
        assert error.status == 400


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_the_samples_themselves_decode(name):
    assert decode_image_bytes(SAMPLES[name], LIMITS).shape[0] == 3


@pytest.mark.parametrize("kept", [1, 2, 3])
def test_a_gif_whose_second_frame_header_is_cut_short_is_a_client_error(kept):
    """Found by test_images_with_bytes_spliced_in: Pillow's GIF plugin counts frames by reading
    each frame's header and raised struct.error (a 500) on one cut short after `kept` bytes."""
    frames = [Image.new("RGB", (8, 8), (red, 0, 0)) for red in (0, 50)]  # no 0x2C in the palette
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    second_frame = gif.rindex(b",")  # the second frame's image separator
    with pytest.raises(ClientError, match="could not be decoded") as raised:
        decode_image_bytes(gif[:second_frame + kept] + b";", LIMITS)
    assert raised.value.status == 400
