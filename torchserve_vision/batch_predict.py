"""Send many images to a running TorchServe and record one answer line per image: `predict
PATH...` (torchserve_vision/cli/predict.py). Imports no torch.

- Before any image is sent, `served_model` checks the server: reachable, the key accepted, the
  model (and version) served with a READY worker; each failure is a PredictError that says what
  to do. Its workers and batch size give the default concurrency.
- `PredictionRun` keeps `concurrency` requests in flight (a thread each, with its own keep-alive
  connection) and hands every finished image to a sink as a `PredictionLine` (path, HTTP status,
  answer or error, latency), in the order they finish. A bad image is one failed line; the run
  goes on. An expired key is refreshed through the key file; a refused key, or a model that
  stops being served, ends the run with a PredictError.
- `AnswerLog` is the JSON-lines file: each line written whole and flushed, so an interrupted run
  leaves complete lines only (a partial last line, from a crash mid-write, is cut on resume), and
  `--resume` skips the paths it holds with status 200.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from torchserve_vision.client import ManagementError, TorchServeClient
from torchserve_vision.errors import CommandError
from torchserve_vision.http_connection import KeepAliveConnection
from torchserve_vision.image_inputs import ImageInput

DEFAULT_CONCURRENCY = 8         # when the management API does not say the model's workers
IN_FLIGHT_PER_BATCH_SLOT = 2    # requests per (worker x batch size): one batch computing, one waiting
INVALID_KEY = "InvalidKeyException"
MODEL_NOT_FOUND = "ModelNotFoundException"
KEY_REFRESH_INTERVAL_S = 60.0
START_HINT = "start it with `torchserve-vision server start`, or give --inference-url"


class PredictError(CommandError):
    """The images cannot be sent: the server, the key or the model is not as needed."""


@dataclass(frozen=True)
class ServedModel:
    """What the management API says of the model's version that answers (None: not asked)."""

    version: str | None
    ready_workers: int | None
    batch_size: int | None

    def default_concurrency(self) -> int:
        if self.ready_workers and self.batch_size:
            return IN_FLIGHT_PER_BATCH_SLOT * self.ready_workers * self.batch_size
        return DEFAULT_CONCURRENCY


@dataclass(frozen=True)
class PredictionLine:
    """One image's outcome: `status` 0 when no HTTP answer came (`error` says why)."""

    path: str
    status: int
    latency_ms: float
    answer: Any = None
    error: Any = None

    @property
    def ok(self) -> bool:
        return self.status == 200

    def to_json(self) -> str:
        line: dict[str, Any] = {"path": self.path, "status": self.status,
                                "latency_ms": round(self.latency_ms, 2)}
        line["answer" if self.ok else "error"] = self.answer if self.ok else self.error
        return json.dumps(line, separators=(",", ":"))


def key_hint(client: TorchServeClient) -> str:
    if client.key_file is None:
        return ("the server has token authorization on: give --key-file with its key_file.json "
                "(.run/key_file.json for `torchserve-vision server start`), or TS_KEY_FILE")
    return (f"the server refused the keys in {client.key_file.path}: is it this server's key file "
            "(it writes a new one at every start)?")


def server_failure(error: ManagementError, client: TorchServeClient, api: str, url: str) -> PredictError:
    """A failed check of the server as a PredictError saying what to do."""
    if error.status == 0:
        return PredictError(f"cannot reach TorchServe's {api} API at {url} ({error.message}); {START_HINT}")
    if INVALID_KEY in error.message or error.status == 401:
        return PredictError(key_hint(client))
    return PredictError(f"TorchServe's {api} API at {url} answered {error.status}: {error.message}")


def served_model(client: TorchServeClient, model: str, version: str | None) -> ServedModel:
    """Check that TorchServe answers with the key given and serves `model` (`version`, else its
    default) with a READY worker; PredictError otherwise. When the management API cannot be
    reached (a server that does not expose it here), only the inference API is checked."""
    try:
        client.call("GET", "/ping", kind="inference")
    except ManagementError as error:
        raise server_failure(error, client, "inference", client.inference_url) from None
    try:
        described = client.describe(model, version)
    except ManagementError as error:
        if error.status == 0:
            return ServedModel(None, None, None)
        if error.status == 404:
            raise PredictError(not_served(client, model, version)) from None
        raise server_failure(error, client, "management", client.management_url) from None
    chosen = described[0]
    ready = sum(worker.get("status") == "READY" for worker in chosen.get("workers", []))
    served_version = str(chosen.get("modelVersion"))
    if ready == 0:
        raise PredictError(f"{model} {served_version} has no READY worker "
                           f"({len(chosen.get('workers', []))} starting or failed): wait and see "
                           f"`torchserve-vision models describe {model}`, or scale it with `models scale`")
    return ServedModel(served_version, ready, int(chosen.get("batchSize") or 1))


def not_served(client: TorchServeClient, model: str, version: str | None) -> str:
    """The message for a model or version the server does not serve, with what it serves."""
    try:
        served = sorted(entry["modelName"] for entry in client.list_models())
    except ManagementError:
        served = []
    what = f"{model} {version}" if version else model
    listing = f"; it serves {', '.join(served)}" if served else "; it serves no model"
    if version and model in served:
        listing = f"; see `torchserve-vision models describe {model}` for its versions"
    return f"TorchServe at {client.inference_url} does not serve {what}{listing}"


class AnswerLog:
    """The JSON-lines answers file (or standard output)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def write(self, line: PredictionLine) -> None:
        text = line.to_json() + "\n"
        with self.lock:
            self.stream.write(text)
            self.stream.flush()


def answered_paths(path: Path) -> set[str]:
    """The paths with status 200 in an answers file (none when it does not exist); a partial
    last line (no newline: a run killed while writing it) is cut from the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as file:
            file.truncate(len(complete))
    answered = set()
    for number, raw in enumerate(complete.decode("utf-8").splitlines(), start=1):
        try:
            line = json.loads(raw)
        except ValueError:
            raise PredictError(f"{path}, line {number}: not an answer line of `predict --out` "
                               "(give another --out, or remove the file)") from None
        if isinstance(line, dict) and line.get("status") == 200 and isinstance(line.get("path"), str):
            answered.add(line["path"])
    return answered


@dataclass
class RunCounts:
    answered: int = 0
    failed: int = 0
    started_s: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> int:
        return self.answered + self.failed

    def images_per_s(self) -> float:
        return self.done / max(time.perf_counter() - self.started_s, 1e-9)


class PredictionRun:
    """`images` posted to `url` with `concurrency` in flight; see the module's docstring."""

    def __init__(self, client: TorchServeClient, url: str, headers: dict[str, str], concurrency: int,
                 timeout_s: float = 60.0) -> None:
        if concurrency < 1:
            raise PredictError(f"--concurrency must be at least 1, got {concurrency}")
        self.client = client
        self.url = url
        self.headers = {"Content-Type": "application/octet-stream", **headers}
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.key_lock = threading.Lock()
        self.key_generation = 0
        self.key_refreshed_s = 0.0
        self.fatal: PredictError | None = None
        self.counts = RunCounts()

    def run(self, images: Sequence[ImageInput], sink: Callable[[PredictionLine], None],
            progress: Callable[[RunCounts], None] | None = None) -> RunCounts:
        """Every image's line to `sink` (called from the sending threads, as each finishes);
        raises the run's PredictError, if any, after the requests in flight have finished."""
        pending: queue.SimpleQueue[ImageInput] = queue.SimpleQueue()
        for image in images:
            pending.put(image)
        lock = threading.Lock()

        def worker() -> None:
            generation = self.key_generation
            connection = self.connection()
            for image in drained(pending):
                if self.fatal is not None:
                    return
                line = self.send(connection, generation, image)
                if line is None and self.fatal is None:     # the key was refreshed: once more
                    generation, connection = self.key_generation, self.connection()
                    line = self.send(connection, generation, image)
                if line is None:
                    self.stop(PredictError(key_hint(self.client)))
                    return
                sink(line)
                with lock:
                    if line.ok:
                        self.counts.answered += 1
                    else:
                        self.counts.failed += 1
                    if progress is not None:
                        progress(self.counts)

        threads = [threading.Thread(target=worker, name=f"predict-{index}", daemon=True)
                   for index in range(min(self.concurrency, len(images)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.fatal is not None:
            raise self.fatal
        return self.counts

    def connection(self) -> KeepAliveConnection:
        return KeepAliveConnection(self.url, self.timeout_s, dict(self.headers))

    def send(self, connection: KeepAliveConnection, generation: int,
             image: ImageInput) -> PredictionLine | None:
        """One image's line; None when its key was refused and a newer one is there to send it
        with (`generation`: the key the connection carries)."""
        try:
            body = image.path.read_bytes()
        except OSError as error:
            return PredictionLine(image.key, 0, 0.0,
                                  error={"message": f"cannot read the file: {error.strerror}"})
        started = time.perf_counter()
        status = connection.post(body)
        latency_ms = (time.perf_counter() - started) * 1000
        if status == 0:
            return PredictionLine(image.key, 0, latency_ms,
                                  error={"message": f"no answer: {connection.last_error}"})
        parsed = parsed_body(connection.last_body)
        if status == 200:
            return PredictionLine(image.key, status, latency_ms, answer=parsed)
        kind = parsed.get("type", "") if isinstance(parsed, dict) else ""
        if kind == INVALID_KEY:
            if not self.newer_key_than(generation):
                self.stop(PredictError(key_hint(self.client)))
            return None
        if kind == MODEL_NOT_FOUND:
            self.stop(PredictError(f"{self.url} answered 404: {parsed.get('message', '')}"))
            return None
        return PredictionLine(image.key, status, latency_ms, error=parsed)

    def newer_key_than(self, generation: int) -> bool:
        """Whether there is a key newer than `generation`'s: one refreshed since, or one refreshed
        now from the key file (not again within KEY_REFRESH_INTERVAL_S: a key refused so soon
        after its refresh is not the server's)."""
        with self.key_lock:
            if self.key_generation > generation:
                return True
            recently = time.monotonic() - self.key_refreshed_s < KEY_REFRESH_INTERVAL_S
            if self.client.key_file is None or (self.key_generation > 0 and recently):
                return False
            try:
                self.client.refresh_key("inference")
            except ManagementError:
                return False
            self.headers.update(self.client.auth_headers("inference"))
            self.key_generation += 1
            self.key_refreshed_s = time.monotonic()
            return True

    def stop(self, error: PredictError) -> None:
        """End the run with `error` (the first such error wins)."""
        if self.fatal is None:
            self.fatal = error


def drained(pending: queue.SimpleQueue[ImageInput]) -> Iterator[ImageInput]:
    while True:
        try:
            yield pending.get_nowait()
        except queue.Empty:
            return


def parsed_body(body: bytes) -> Any:
    """An answer's JSON, or its text when it is not JSON."""
    try:
        return json.loads(body)
    except ValueError:
        return {"message": body.decode("utf-8", "replace").strip()}
