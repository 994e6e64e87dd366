from __future__ import annotations

import base64

import pytest

from handlers.ground.errors import ClientError
from handlers.request.request_body import extract_image_bytes

IMAGE = b"\x89PNG\r\n\x1a\nfake"


def test_raw_body_arrives_as_bytearray():
    assert extract_image_bytes({"body": bytearray(IMAGE)}) == IMAGE


def test_json_body_with_base64_data():
    assert extract_image_bytes({"body": {"data": base64.b64encode(IMAGE).decode()}}) == IMAGE


def test_json_body_with_a_data_url():
    url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    assert extract_image_bytes({"body": {"data": url}}) == IMAGE


@pytest.mark.parametrize("field", ["data", "image", "file", "upload"])
def test_multipart_field_is_found_by_name_or_as_the_only_file(field):
    assert extract_image_bytes({field: bytearray(IMAGE)}) == IMAGE


def test_multipart_prefers_the_data_field_over_others():
    assert extract_image_bytes({"other": bytearray(b"x"), "data": bytearray(IMAGE)}) == IMAGE


@pytest.mark.parametrize(
    ("row", "error_type"),
    [
        ({"body": bytearray()}, "EmptyBody"),
        ({}, "EmptyBody"),
        ({"body": {"data": "not base64!!"}}, "InvalidBase64"),
        ({"body": {"image": "aGVsbG8="}}, "InvalidJson"),
        ({"body": {"data": 5}}, "InvalidJson"),
        ({"body": "plain text"}, "NotAnImage"),
        ({"a": bytearray(b"1"), "b": bytearray(b"2")}, "AmbiguousUpload"),
    ],
)
def test_malformed_requests_are_400_with_a_named_error(row, error_type):
    with pytest.raises(ClientError) as caught:
        extract_image_bytes(row)
    assert caught.value.status == 400
    assert caught.value.error_type == error_type
