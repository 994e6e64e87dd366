"""The per-request client error: one bad request gets its own 4xx, never its batch-mates'."""

from __future__ import annotations

import json

HTTP_PHRASES = {400: "Bad Request", 413: "Payload Too Large", 415: "Unsupported Media Type"}


class ClientError(Exception):
    """A fault of the request itself (undecodable, too large, wrong type).

    `status` is the HTTP status for that request alone; `error_type` is a short stable name
    clients can match on; the message says what was wrong and, where it can, how to fix it.
    Server faults (a bug, CUDA out of memory) must never be raised as a ClientError.
    """

    def __init__(self, status: int, error_type: str, message: str) -> None:
        if not 400 <= status < 500:
            raise ValueError(f"ClientError status must be 4xx, got {status}")
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message

    @property
    def phrase(self) -> str:
        return HTTP_PHRASES.get(self.status, "Client Error")

    def to_json_bytes(self) -> bytes:
        """The response body, shaped like TorchServe's own error bodies."""
        body = {"code": self.status, "type": self.error_type, "message": self.message}
        return json.dumps(body).encode("utf-8")

    def of_image(self, index: int) -> ClientError:
        """This error for image `index` of a request that carries several: same status and
        type, the message naming the image."""
        return ClientError(self.status, self.error_type, f"image {index}: {self.message}")
