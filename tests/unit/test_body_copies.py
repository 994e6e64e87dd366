"""How often a request's bytes are copied between TorchServe's reader and the decoder: once, when
the image is taken out of the row (handlers.request.request_body); not to find out that a body is
not an Open Inference Protocol request (handlers.protocol_stage), not to hand it to the decoder
(handlers.request.jpeg_batches). A v2 request in the binary extension: each image once."""

from __future__ import annotations

import ctypes
import io
import json
import tracemalloc

import torch
from PIL import Image

from handlers.batch.request_slot import RequestSlot
from handlers.ground.limits import ImageLimits
from handlers.protocol_stage import ProtocolStage
from handlers.request import jpeg_batches
from handlers.request.decode import decode_images
from handlers.request.inference_protocol import BINARY_HEADER
from handlers.request.request_body import extract_images
from tests.images import photo_bytes

MEBIBYTE = 1 << 20


def jpeg_of(name: str) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(photo_bytes(name))).convert("RGB").save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def address(data: bytes) -> int:
    """Where a bytes object's contents are (ctypes hands out the object's own buffer)."""
    value = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert value is not None
    return value


def test_the_decoder_reads_the_bytes_taken_out_of_the_row_in_place(monkeypatch):
    row = {"body": bytearray(jpeg_of("chelsea.png"))}       # as TorchServe's reader hands it over
    (data,), _ = extract_images(row)
    read_at: list[int] = []
    real = jpeg_batches.decode_jpeg

    def spy(tensors, **options):
        read_at.extend(tensor.data_ptr() for tensor in tensors)
        return real(tensors, **options)

    monkeypatch.setattr(jpeg_batches, "decode_jpeg", spy)
    (image,) = decode_images([data], ImageLimits())
    assert isinstance(image, torch.Tensor) and image.shape[0] == 3
    assert read_at == [address(data)]


def slot_of(body: bytearray, headers: dict[str, str] | None = None) -> RequestSlot:
    return RequestSlot(0, {"body": body}, (headers or {}).get)


def peak_bytes_allocated(run) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_image_body_is_not_copied_to_find_that_it_is_no_v2_request():
    body = bytearray(b"\xff\xd8\xff" + bytes(8 * MEBIBYTE))
    stage = ProtocolStage("m", "1.0", lambda answer: [])
    slot = slot_of(body)
    assert peak_bytes_allocated(lambda: stage.read(slot)) < MEBIBYTE // 8
    assert slot.v2 is None and slot.row["body"] is body
    # a v2 request in JSON, leading whitespace and all, is still one
    json_slot = slot_of(bytearray(b' \n\t{"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", '
                                  b'"data": ["aGk="]}]}'))
    stage.read(json_slot)
    assert json_slot.v2 is not None and json_slot.error is None


def test_each_image_of_a_binary_v2_request_is_copied_out_once():
    images = [bytes([index]) * (4 * MEBIBYTE) for index in (1, 2)]
    elements = b"".join(len(image).to_bytes(4, "little") + image for image in images)
    header = json.dumps({"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(elements)}}]}).encode()
    slot = slot_of(bytearray(header + elements), {BINARY_HEADER: str(len(header))})
    stage = ProtocolStage("m", "1.0", lambda answer: [])
    peak = peak_bytes_allocated(lambda: stage.read(slot))
    assert slot.error is None and slot.row["instances"] == images
    assert peak < sum(map(len, images)) + MEBIBYTE     # the images, not the body again besides
