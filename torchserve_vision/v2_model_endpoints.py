"""The model endpoints of the Open Inference Protocol that TorchServe 0.12 does not route, answered
from its management API: `GET /v2/models/{m}[/versions/{v}]` (model metadata) and
`GET /v2/models/{m}[/versions/{v}]/ready` (model readiness). `server run --front-port` puts them
beside TorchServe's inference address (torchserve_vision.front_proxy).

- Ready: 200 when the version (the default one without `versions/{v}`) has at least one READY
  worker, 400 when it has none, 404 when it is not registered: Triton's convention (a 200 is
  true, a 4xx false), which `tritonclient`'s `is_model_ready` reads.
- Metadata: the model's name, its registered versions, `platform` "pytorch_torchserve", and the
  input and outputs its handler declares (`describe()["v2"]`, asked once per version through a
  worker and kept: an archive's declaration never changes); a version whose handler declares
  none gets empty lists. 404 with `{"error": ...}` when the model or version is not registered.
- With token authorization on, a request must carry TorchServe's inference key, as an
  inference request must (401 otherwise).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchserve_vision.client import ManagementError, TorchServeClient
from torchserve_vision.server_state import ready_workers

ROUTE = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<ready>/ready)?")
PLATFORM = "pytorch_torchserve"
Answer = tuple[int, dict[str, Any]]


def is_model_endpoint(path: str) -> bool:
    return ROUTE.fullmatch(path.split("?", 1)[0]) is not None


@dataclass
class V2ModelEndpoints:
    """`client()`: a management client (keys refreshed); `required_headers()`: the headers a
    caller must send ({} with token authorization off)."""

    client: Callable[[], TorchServeClient]
    required_headers: Callable[[], Mapping[str, str]] = dict
    _declared: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, path: str, headers: Mapping[str, str]) -> Answer:
        """(status, JSON body) for a GET of `path` (404 for a path that is not one of these)."""
        route = ROUTE.fullmatch(path.split("?", 1)[0])
        if route is None:
            return 404, {"error": f"not a model endpoint: {path}"}
        # Header names are case-insensitive (HAProxy forwards them in lower case).
        sent = {name.lower(): value for name, value in headers.items()}
        if any(sent.get(name.lower()) != value for name, value in self.required_headers().items()):
            return 401, {"error": "token authorization is on: send the inference key"}
        model, version = route["model"], route["version"]
        try:
            described = self.client().describe(model, version)[0]
        except ManagementError as error:
            if error.status == 404:
                what = f"{model} {version}" if version else model
                return 404, {"error": f"{what} is not registered"}
            return 503, {"error": f"TorchServe's management API answered {error.status}"}
        if route["ready"]:
            return (200, {}) if ready_workers(described) > 0 else (400, {})
        return 200, self.metadata(model, described)

    def metadata(self, model: str, described: Mapping[str, Any]) -> dict[str, Any]:
        version = str(described["modelVersion"])
        versions = [str(v["modelVersion"]) for v in self.client().describe(model, "all")]
        declared = self.declared(model, version)
        return {"name": model, "versions": versions, "platform": PLATFORM,
                "inputs": declared.get("inputs", []), "outputs": declared.get("outputs", [])}

    def declared(self, model: str, version: str) -> dict[str, Any]:
        """The version's handler's `v2` declaration, asked once through a worker."""
        with self._lock:
            known = self._declared.get((model, version))
        if known is not None:
            return known
        try:
            described = self.client().describe(model, version, customized=True)[0]
        except ManagementError:
            return {}          # no worker answered (yet): asked again next time
        custom = described.get("customizedMetadata")
        if isinstance(custom, str):
            try:
                custom = json.loads(custom)
            except ValueError:
                custom = None
        declared = custom.get("v2", {}) if isinstance(custom, dict) else {}
        if isinstance(custom, dict):
            with self._lock:
                self._declared[(model, version)] = declared
        return declared
