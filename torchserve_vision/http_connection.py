"""One keep-alive HTTP/1.1 connection for posting bodies back to back (http.client, TCP_NODELAY, no
per-request set-up): the load generator's clients and `predict`'s. Imports no torch."""

from __future__ import annotations

import http.client
import socket
from urllib.parse import urlparse

# The header naming the version that answered (handlers.torchserve_context.MODEL_VERSION_HEADER,
# not imported from there: this module runs without torch).
MODEL_VERSION_HEADER = "X-Model-Version"


class KeepAliveConnection:
    """One keep-alive HTTP connection (HTTPS for an https:// URL); reconnects after an error."""

    def __init__(self, url: str, timeout_s: float, headers: dict[str, str]) -> None:
        parsed = urlparse(url)
        self.secure = parsed.scheme == "https"
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or (443 if self.secure else 80)
        self.path = parsed.path or "/"
        self.timeout_s = timeout_s
        self.headers = headers
        self.connection: http.client.HTTPConnection | None = None
        self.last_body = b""   # the body of the last answer (b"" after a connection error)
        self.last_version = ""  # the last answer's X-Model-Version ("" without one)
        self.last_error = ""    # why the last post got no answer ("" when it got one)
        self.last_retry_after_s: float | None = None  # the last answer's Retry-After in seconds

    def post(self, body: bytes) -> int:
        try:
            if self.connection is None:
                kind = http.client.HTTPSConnection if self.secure else http.client.HTTPConnection
                self.connection = kind(self.host, self.port, timeout=self.timeout_s)
                self.connection.connect()
                assert self.connection.sock is not None
                self.connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connection.request("POST", self.path, body=body, headers=self.headers)
            answer = self.connection.getresponse()
            self.last_body = answer.read()
            self.last_version = answer.getheader(MODEL_VERSION_HEADER, "")
            self.last_retry_after_s = retry_after_s(answer.getheader("Retry-After"))
            self.last_error = ""
            if answer.getheader("connection", "").lower() == "close":
                self.close()
            return answer.status
        except (OSError, http.client.HTTPException) as error:
            self.close()
            self.last_body, self.last_version, self.last_retry_after_s = b"", "", None
            self.last_error = str(error) or type(error).__name__
            return 0

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
        self.connection = None


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header of delay-seconds (the form this project's server sends) as seconds;
    None when absent or in another form."""
    if value is None or not value.strip().isdigit():
        return None
    return float(value.strip())
