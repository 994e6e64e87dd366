"""The one HTTP client for TorchServe's inference and management APIs (every command, the
rollouts and the lab use it; the load generator takes its keys from it).

- Token authorization: with a key file (TorchServe writes `key_file.json` into its working
  directory), every call carries the right key; an expired key (by the file's expiration time,
  or refused by the server with InvalidKeyException) is refreshed through `GET /token` with the
  API key, and the call is retried once. Without a key file, no key is sent.
- Transient connection errors are retried a bounded number of times, with backoff; a call that
  gets no answer in `timeout_s` raises ManagementError (status 0) like any other failure.
- Register and scale are asynchronous: a call that waited for workers to load would hold a
  frontend thread for as long as a worker takes to start (seen: /ping and GET /models went
  unanswered meanwhile). Callers poll `describe` for READY workers instead (see rollout.py).
- `dry_run`: calls that change the server are printed instead of sent; reads still run, so a dry
  run shows exactly the changes it would make to the server as it is.
- Any non-2xx answer raises ManagementError carrying the server's own message; an unregister
  that gets a server error is tried again a few times first (TorchServe 0.12's passing 500).
- With a metrics address, `requests_in_batch` reads how many requests workers are computing
  (the frontend agent's gauge; TorchServe's describe shows only the queue).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import requests

from torchserve_vision.errors import CommandError
from torchserve_vision.prometheus_text import parse_samples

DEFAULT_MANAGEMENT_URL = "http://127.0.0.1:8081"
DEFAULT_INFERENCE_URL = "http://127.0.0.1:8080"
DEFAULT_METRICS_URL = "http://127.0.0.1:8082"
IN_BATCH_METRIC = "ts_requests_in_batch"   # the frontend agent's (ContinuousBatching.java)
MUTATING_METHODS = ("POST", "PUT", "DELETE")


STALLING_DESCRIBE = (
    "not asked: {model} {version} asks for queued batching and this TorchServe runs without the "
    "frontend agent, so TorchServe's own ContinuousBatching serves it, and on TorchServe 0.12 a "
    "customized describe (?customized=true) is answered by its workers over and over and the "
    "version never takes another request. Start the server with `torchserve-vision server "
    "start`, or add the agent to config.properties' vmargs (README, \"Starting TorchServe by "
    "hand\")")


def gathered_by_agent(in_batch: dict[tuple[str, str], int] | None, description: dict[str, Any]
                      ) -> bool | None:
    """Whether the agent gathers the batches of the version `description` (describe's) says,
    from what TorchServeClient.requests_in_batch read. None when unknown: the series could not be
    read, or the version has no READY worker yet (the agent's series of a version appears with
    its first worker, so its absence says nothing before)."""
    if in_batch is None or not has_ready_worker(description):
        return None
    return (str(description.get("modelName")), str(description.get("modelVersion"))) in in_batch


def has_ready_worker(description: dict[str, Any]) -> bool:
    return any(worker.get("status") == "READY" for worker in description.get("workers", []))


class ManagementError(CommandError, RuntimeError):
    """A call failed: the HTTP status (0 when the server could not be reached) and its message."""

    def __init__(self, status: int, message: str, call: str) -> None:
        super().__init__(f"{call} -> {status}: {message}")
        self.status = status
        self.message = message


@dataclass
class KeyFile:
    """TorchServe's key file: management / inference keys with expiry, and the API key."""

    path: Path

    def read(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as error:
            raise ManagementError(0, f"cannot read key file {self.path}: {error}", "key file") from None

    def key(self, kind: str) -> str:
        return str(self.read()[kind]["key"])

    def expired(self, kind: str, margin_s: float = 30.0) -> bool:
        stamp = self.read()[kind].get("expiration time")
        if not stamp:
            return False
        # e.g. "2026-11-22T01:42:59.967777420Z": nanoseconds, which fromisoformat refuses
        expires = datetime.fromisoformat(stamp.split(".")[0].rstrip("Z") + "+00:00")
        return (expires - datetime.now(timezone.utc)).total_seconds() < margin_s


@dataclass
class TorchServeClient:
    management_url: str = DEFAULT_MANAGEMENT_URL
    inference_url: str = DEFAULT_INFERENCE_URL
    key_file: KeyFile | None = None
    metrics_url: str | None = None     # None: requests in a batch are not read
    dry_run: bool = False
    attempts: int = 4
    timeout_s: float = 60.0
    unregister_attempts: int = 5
    unregister_retry_s: float = 1.0
    session: requests.Session = field(default_factory=requests.Session)

    @classmethod
    def from_environment(cls, management_url: str | None = None, inference_url: str | None = None,
                         key_file: str | None = None, dry_run: bool = False,
                         metrics_url: str | None = None) -> TorchServeClient:
        """Flags win; else TS_MANAGEMENT_URL / TS_INFERENCE_URL / TS_KEY_FILE / TS_METRICS_URL;
        else the defaults."""
        key_path = key_file or os.environ.get("TS_KEY_FILE")
        return cls(
            management_url=(management_url or os.environ.get("TS_MANAGEMENT_URL")
                            or DEFAULT_MANAGEMENT_URL).rstrip("/"),
            inference_url=(inference_url or os.environ.get("TS_INFERENCE_URL")
                           or DEFAULT_INFERENCE_URL).rstrip("/"),
            key_file=KeyFile(Path(key_path)) if key_path else None,
            dry_run=dry_run,
            metrics_url=(metrics_url or os.environ.get("TS_METRICS_URL")
                         or DEFAULT_METRICS_URL).rstrip("/"),
        )

    # --- keys ----------------------------------------------------------------------------------
    def refresh_key(self, kind: str) -> None:
        """Ask the server for a new `kind` key (it rewrites the key file), with the API key, sent
        as every call is: a management port that does not answer (yet: a starting frontend writes
        the key file before it binds that port) is a ManagementError, as for any other call."""
        assert self.key_file is not None
        answer = self._send("GET", f"{self.management_url}/token?{urlencode({'type': kind})}", "API")
        if answer.status_code >= 300:
            raise ManagementError(answer.status_code, answer.text, f"GET /token?type={kind}")

    def auth_headers(self, kind: str) -> dict[str, str]:
        if self.key_file is None:
            return {}
        if self.key_file.expired(kind):
            self.refresh_key(kind)
        return {"Authorization": f"Bearer {self.key_file.key(kind)}"}

    # --- calls ---------------------------------------------------------------------------------
    def _send(self, method: str, url: str, kind: str, **kwargs: Any) -> requests.Response:
        delay_s = 0.5
        for attempt in range(1, self.attempts + 1):
            try:
                return self.session.request(method, url, headers={**kwargs.pop("headers", {}),
                                                                  **self.auth_headers(kind)},
                                            timeout=self.timeout_s, **kwargs)
            except requests.ConnectionError as error:
                if attempt == self.attempts:
                    raise ManagementError(0, f"cannot reach the server: {error}",
                                          f"{method} {url}") from None
                time.sleep(delay_s)
                delay_s *= 2
            except requests.RequestException as error:  # a time-out: the call may have happened
                raise ManagementError(0, f"no answer: {error}", f"{method} {url}") from None
        raise AssertionError("unreachable")

    def _answer(self, method: str, url: str, kind: str, **kwargs: Any) -> requests.Response:
        """The server's answer, sent again with a fresh key when the key was refused."""
        answer = self._send(method, url, kind, **kwargs)
        if answer.status_code >= 300 and self.key_file is not None and "InvalidKey" in answer.text:
            self.refresh_key(kind)
            answer = self._send(method, url, kind, **kwargs)
        return answer

    def call(self, method: str, path: str, params: dict[str, Any] | None = None,
             kind: str = "management", **kwargs: Any) -> Any:
        """One API call; returns the parsed JSON answer (or text), raises ManagementError."""
        base = self.management_url if kind == "management" else self.inference_url
        query = f"?{urlencode(params)}" if params else ""
        url = f"{base}{path}{query}"
        if self.dry_run and method in MUTATING_METHODS and kind == "management":
            print(f"[dry-run] {method} {url}")
            return {"status": "dry run"}
        answer = self._answer(method, url, kind, **kwargs)
        if answer.status_code >= 300:
            raise ManagementError(answer.status_code, server_message(answer), f"{method} {path}{query}")
        try:
            return answer.json()
        except ValueError:
            return answer.text

    # --- the management API ------------------------------------------------------------------
    def list_models(self) -> list[dict[str, Any]]:
        return list(self.call("GET", "/models", {"limit": 1000})["models"])

    def describe(self, model: str, version: str | None = "all",
                 customized: bool = False) -> list[dict[str, Any]]:
        """One version, "all" versions, or (version None) the default version of `model`. With
        `customized` (one version), one of its workers adds `customizedMetadata`: our handlers
        report their device, precision and the runner of each network (compiled package or
        eager, and why); the request waits in the model's queue like an inference.

        A customized describe is refused (ManagementError, status 0, nothing sent to the
        workers) for a version that TorchServe's own ContinuousBatching serves, i.e. one asking for
        queued batching on a frontend without this project's agent (`batched_by_agent` False):
        TorchServe 0.12's Model.pollInferJob keeps a describe job both in the worker's batch and
        at the head of the model's queue, so the workers answer it over and over and never take
        another request of that version again (docs/configuration.md, "Batching")."""
        path = f"/models/{model}" + (f"/{version}" if version else "")
        if customized:
            plain = self.call("GET", path)
            if plain and plain[0].get("continuousBatching"):
                in_batch = self.requests_in_batch()
                if in_batch is not None and not has_ready_worker(plain[0]):
                    return list(plain)      # no worker to answer it, none to say who gathers it
                if gathered_by_agent(in_batch, plain[0]) is False:
                    raise ManagementError(0, STALLING_DESCRIBE.format(
                        model=model, version=plain[0]["modelVersion"]), f"GET {path}?customized=true")
        return list(self.call("GET", path, {"customized": "true"} if customized else None))

    def register(self, archive: str, batch_size: int, max_batch_delay_ms: int, initial_workers: int,
                 response_timeout_s: int, startup_timeout_s: int | None = None) -> Any:
        """Register without waiting for workers (poll `describe` for READY ones)."""
        params: dict[str, Any] = {
            "url": archive, "batch_size": batch_size, "max_batch_delay": max_batch_delay_ms,
            "initial_workers": initial_workers, "response_timeout": response_timeout_s,
            "synchronous": "false",
        }
        if startup_timeout_s is not None:
            params["startup_timeout"] = startup_timeout_s
        return self.call("POST", "/models", params)

    def takes_registrations(self) -> bool:
        """Whether the server registers models. TorchServe answers a POST /models without a url
        405 when its model API is off (`enable_model_api=false`, as in the production config) and
        400 ("Parameter url is required.") when it is on: nothing is registered either way, so
        this asks also in a dry run."""
        answer = self._answer("POST", f"{self.management_url}/models", "management")
        return answer.status_code != 405

    def scale(self, model: str, version: str, min_workers: int, max_workers: int) -> Any:
        """Set worker counts without waiting for them (poll `describe` for READY ones)."""
        return self.call("PUT", f"/models/{model}/{version}", {
            "min_worker": min_workers, "max_worker": max_workers, "synchronous": "false"})

    def set_default(self, model: str, version: str) -> Any:
        return self.call("PUT", f"/models/{model}/{version}/set-default")

    def unregister(self, model: str, version: str) -> Any:
        """Unregister, trying a server error again (up to `unregister_attempts` calls,
        `unregister_retry_s` apart): TorchServe 0.12 answers 500 (ConcurrentModificationException)
        now and then when a version is unregistered while a worker of it is still loading, or
        while its workers are being stopped after a request; a try a moment later goes through."""
        for attempt in range(1, self.unregister_attempts + 1):
            try:
                return self.call("DELETE", f"/models/{model}/{version}")
            except ManagementError as error:
                if error.status < 500 or attempt == self.unregister_attempts:
                    raise
                time.sleep(self.unregister_retry_s)
        raise AssertionError("unreachable")

    def batched_by_agent(self, model: str, version: str) -> bool | None:
        """Whether this project's frontend agent gathers `model` `version`'s batches
        (`gathered_by_agent` of its description and the metrics endpoint's series)."""
        return gathered_by_agent(self.requests_in_batch(), self.call("GET", f"/models/{model}/{version}")[0])

    # --- the metrics API ---------------------------------------------------------------------
    def requests_in_batch(self) -> dict[tuple[str, str], int] | None:
        """Requests taken into a batch by a worker and not yet answered, per (model, version)
        that the frontend agent serves with queued batching (a version served otherwise is
        absent: its batches cannot be seen). None without a metrics address, or when it does
        not answer."""
        if self.metrics_url is None:
            return None
        try:
            answer = self.session.get(f"{self.metrics_url}/metrics",
                                      params={"name[]": IN_BATCH_METRIC}, timeout=self.timeout_s)
        except requests.RequestException:
            return None
        if answer.status_code >= 300:
            return None
        counts: dict[tuple[str, str], int] = {}
        for sample in parse_samples(answer.text):
            if sample.name == IN_BATCH_METRIC:
                pair = (sample.labels.get("model_name", ""), sample.labels.get("model_version", ""))
                counts[pair] = counts.get(pair, 0) + round(sample.value)
        return counts

    # --- the inference API -------------------------------------------------------------------
    def prediction_url(self, model: str, version: str | None = None) -> str:
        return self.inference_url + prediction_path(model, version)

    def inference_headers(self) -> dict[str, str]:
        """Headers for posting raw image bytes (with the inference key when tokens are on), for
        callers that keep their own connections (the load generator)."""
        return {"Content-Type": "application/octet-stream", **self.auth_headers("inference")}

    def predict(self, model: str, version: str | None, image: bytes,
                headers: dict[str, str] | None = None) -> Any:
        """POST the raw image bytes to /predictions/{model}[/{version}]; `headers` carry
        per-request options (e.g. X-Score-Threshold)."""
        return self.call("POST", prediction_path(model, version), kind="inference", data=image,
                         headers={"Content-Type": "application/octet-stream", **(headers or {})})

    def ping(self) -> bool:
        """True when /ping answers Healthy (it does before any model is loaded: see
        server_state.models_ready)."""
        try:
            answer = self.call("GET", "/ping", kind="inference")
        except (ManagementError, KeyError):
            return False
        return isinstance(answer, dict) and answer.get("status") == "Healthy"


def prediction_path(model: str, version: str | None = None) -> str:
    return f"/predictions/{model}" + (f"/{version}" if version else "")


def server_message(answer: requests.Response) -> str:
    try:
        body = answer.json()
    except ValueError:
        return answer.text.strip()
    if isinstance(body, dict) and "message" in body:
        return f"{body.get('type', '')}: {body['message']}".strip(": ")
    return json.dumps(body)
