"""The request protocols as a stage of `handle`: TorchServe's own `/predictions` form and the
Open Inference Protocol (KServe v2). `read` turns a v2 request into the row a `/predictions`
request of the same content would be; `body` writes a settled request's answer or error in the
form it was asked in (see handlers.request.inference_protocol for the v2 wire format). A
request with several images (`instances`) is answered `{"predictions": [one answer per image]}`,
as KServe v1 answers; in v2, with outputs that lead with the number of images."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from handlers.batch.request_slot import RequestSlot
from handlers.ground.errors import ClientError
from handlers.request.inference_protocol import (
    BINARY_HEADER,
    TensorOutput,
    V2Request,
    binary_v2_to_row,
    is_v2_request,
    stacked_outputs,
    v2_error,
    v2_json_in_bytes,
    v2_response,
    v2_to_row,
)


@dataclass(frozen=True)
class ProtocolStage:
    """`outputs`: one answer as v2 tensors (the handler's `v2_outputs`)."""

    model_name: str
    model_version: str
    outputs: Callable[[Any], list[TensorOutput]]

    def read(self, slot: RequestSlot) -> None:
        """Mark a v2 request as one (parsed JSON, JSON that came as bytes, or the binary tensor
        extension) and give it its `/predictions` row; refuse a malformed one."""
        body = slot.row.get("body")
        binary_length = slot.header(BINARY_HEADER)
        if isinstance(body, (bytes, bytearray)):
            # read in place: an image body is not copied to find that it is not a v2 request
            if binary_length is not None:
                self.convert(slot, lambda: binary_v2_to_row(body, binary_length))
            elif (parsed := v2_json_in_bytes(body)) is not None:
                self.convert(slot, lambda: v2_to_row(parsed))
        elif is_v2_request(body):
            self.convert(slot, lambda: v2_to_row(slot.row["body"]))

    @staticmethod
    def convert(slot: RequestSlot, to_row: Callable[[], tuple[dict[str, Any], V2Request]]) -> None:
        slot.v2 = V2Request(None)
        try:
            slot.row, slot.v2 = to_row()
        except ClientError as error:
            slot.refuse(error)

    def body(self, slot: RequestSlot) -> bytes:
        """The JSON body of a settled request."""
        if slot.error is not None:
            if slot.v2 is None:
                return slot.error.to_json_bytes()
            return json.dumps(v2_error(slot.error)).encode("utf-8")
        if slot.v2 is None:
            if slot.several:
                return json.dumps({"predictions": slot.answer}).encode("utf-8")
            return slot.answer_bytes()
        outputs = (stacked_outputs([self.outputs(answer) for answer in slot.answer]) if slot.several
                   else self.outputs(slot.answer))
        return json.dumps(v2_response(self.model_name, self.model_version, slot.v2,
                                      outputs)).encode("utf-8")
