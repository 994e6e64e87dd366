"""A small stand-in for ts.context.Context: request headers in, per-request statuses out."""

from __future__ import annotations

from typing import Any


class FakeContext:
    def __init__(self, model_dir: str, manifest: dict[str, Any], model_yaml_config: dict[str, Any],
                 batch_size: int = 8, request_headers: list[dict[str, str]] | None = None) -> None:
        self.manifest = manifest
        self.model_yaml_config: dict[str, Any] | None = model_yaml_config
        self._system_properties = {"model_dir": model_dir, "gpu_id": None, "batch_size": batch_size}
        self.request_headers = request_headers or []
        self.statuses: dict[int, tuple[int, str]] = {}
        self.content_types: dict[int, str] = {}
        self.response_headers: dict[int, dict[str, str]] = {}

    @property
    def system_properties(self) -> dict[str, Any]:
        return self._system_properties

    def get_request_header(self, idx: int, key: str) -> str | None:
        if idx < len(self.request_headers):
            return self.request_headers[idx].get(key)
        return None

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        self.statuses[idx] = (code, phrase)

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.content_types[idx] = value

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.response_headers.setdefault(idx, {})[key] = value

    def status(self, idx: int) -> int:
        return self.statuses.get(idx, (200, ""))[0]
