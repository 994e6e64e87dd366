"""Extract one request's image bytes from what TorchServe hands the handler.

TorchServe 0.12 gives one dict per request:
- raw body (`curl -T img.jpg`, `--data-binary` with an image content type): `{"body": bytearray}`;
- `application/json`: already parsed, `{"body": {"data": "<base64>"}}`;
- multipart form: one key per form field, named as the client named it (`-F data=@img.jpg`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection, Mapping

from handlers.errors import ClientError

# Multipart field names tried first, in order; otherwise the single binary field is taken.
IMAGE_FIELD_NAMES = ("data", "image", "file", "body")


def _json_image_bytes(payload: object) -> bytes:
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), str):
        raise ClientError(
            400,
            "InvalidJson",
            'a JSON body must be an object {"data": "<base64-encoded image>"}',
        )
    text = payload["data"]
    if text.startswith("data:") and "," in text:  # a data: URL, as browsers produce
        text = text.split(",", 1)[1]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ClientError(400, "InvalidBase64", f"'data' is not valid base64: {error}") from None


def _as_bytes(value: object) -> bytes | None:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return None


def _multipart_image_bytes(row: Mapping[str, object], other_fields: Collection[str]) -> bytes:
    binary_fields = {key: data for key, value in row.items()
                     if key not in other_fields and (data := _as_bytes(value)) is not None}
    for name in IMAGE_FIELD_NAMES:
        if name in binary_fields:
            return binary_fields[name]
    if len(binary_fields) == 1:
        return next(iter(binary_fields.values()))
    if not binary_fields:
        raise ClientError(400, "EmptyBody", "the request carries no image")
    raise ClientError(
        400,
        "AmbiguousUpload",
        f"send one image per request; got form fields {sorted(binary_fields)}",
    )


def extract_image_bytes(row: Mapping[str, object], other_fields: Collection[str] = ()) -> bytes:
    """Return the encoded image of one request, or raise ClientError(400) saying why not.

    `other_fields` names form fields that carry options, not the image.
    """
    body = row.get("body")
    if isinstance(body, Mapping):
        data = _json_image_bytes(body)
    elif isinstance(body, str):
        raise ClientError(
            400,
            "NotAnImage",
            "the body is text; send image bytes with an image Content-Type, "
            'or JSON {"data": "<base64>"}',
        )
    elif body is not None and (raw := _as_bytes(body)) is not None:
        data = raw
    else:
        data = _multipart_image_bytes(row, other_fields)
    if not data:
        raise ClientError(400, "EmptyBody", "the request body is empty")
    return data
