"""Extract one request's image bytes from what TorchServe hands the handler.

TorchServe 0.12 gives one dict per request:
- raw body (`curl -T img.jpg`, `--data-binary` with an image content type): `{"body": bytearray}`;
- `application/json`: already parsed, `{"body": {"data": "<base64>"}}`;
- multipart form: one key per form field, named as the client named it (`-F data=@img.jpg`).

Several images in one request come as `instances` (KServe v1, `POST /v1/models/{m}:predict`):
`{"instances": [{"data": "<base64>"}, "<base64>", ...]}`; the protocol stage also hands a v2
input of shape [n] over in this form (its binary elements as bytes).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection, Mapping

from handlers.ground.errors import ClientError

# Multipart field names tried first, in order; otherwise the single binary field is taken.
IMAGE_FIELD_NAMES = ("data", "image", "file", "body")


def _json_image_bytes(payload: object) -> bytes:
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), str):
        raise ClientError(
            400,
            "InvalidJson",
            'a JSON body must be an object {"data": "<base64-encoded image>"}',
        )
    return _base64_image(payload["data"])


def _base64_image(text: str) -> bytes:
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


def _instance_image(instance: object) -> bytes:
    if isinstance(instance, (bytes, bytearray)):
        data = bytes(instance)
    elif isinstance(instance, str):
        data = _base64_image(instance)
    elif isinstance(instance, Mapping) and isinstance(instance.get("data"), str):
        data = _base64_image(instance["data"])
    else:
        raise ClientError(400, "InvalidInstances",
                          'an instance must be {"data": "<base64-encoded image>"} or a base64 string')
    if not data:
        raise ClientError(400, "EmptyBody", "the image is empty")
    return data


def extract_images(row: Mapping[str, object], other_fields: Collection[str] = (),
                   max_images: int | None = None) -> tuple[list[bytes], bool]:
    """The encoded images of one request and whether it asked for several (`instances`: its
    answer is then a list, one entry per image, even for one). ClientError: 400 for a malformed
    request or image (naming the instance), 413 for more than `max_images`."""
    body = row.get("body")
    fields = body if isinstance(body, Mapping) else row
    instances = fields.get("instances") if isinstance(fields, Mapping) else None
    if instances is None:
        return [extract_image_bytes(row, other_fields)], False
    if not isinstance(instances, list) or not instances:
        raise ClientError(400, "InvalidInstances", "'instances' must be a non-empty list of images")
    if max_images is not None and len(instances) > max_images:
        raise ClientError(413, "TooManyImages", f"{len(instances)} images in one request; this "
                          f"model takes at most {max_images}")
    images = []
    for index, instance in enumerate(instances):
        try:
            images.append(_instance_image(instance))
        except ClientError as error:
            raise error.of_image(index) from None
    return images, True
