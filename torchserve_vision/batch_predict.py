"""Send many images to a running TorchServe and record one answer line per image: `predict
PATH...` (torchserve_vision/cli/predict.py). Imports no torch.

- Before any image is sent, `served_model` checks the server: reachable, the key accepted, the
  model (and version) served with a READY worker; each failure is a PredictError that says what
  to do. Its workers and batch size give the default concurrency.
- `PredictionRun` keeps `concurrency` requests in flight (a pool of threads, each with its own
  keep-alive connection) and accounts for every image: each gets one `PredictionLine` (path, HTTP
  status, answer or error, latency), handed to the sink in the order they finish, or the run
  stops with a PredictError and counts the images left undone (not sent, or their line not
  written). A bad image, or any failure while handling one (reading it, sending it, drawing its
  answer), is that image's failed line and the run goes on; a line that cannot be written (a
  closed pipe, a full disk) stops the run. A 503 (a full queue, no worker yet) is sent again up
  to MAX_503_RETRIES times, after the answer's Retry-After or, without one, a short growing
  backoff. An expired key is refreshed through the key file; a refused key, or a model that
  stops being served, stops the run.
- `AnswerLog` is the JSON-lines file: each line written whole and flushed, so an interrupted run
  leaves complete lines only. `answered_paths` reads it for `--resume`: where a path has several
  lines, its last counts; the file must be an answers file before a byte of it changes (a partial
  last line, from a crash mid-write, is then cut).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
# A 503 (the model's queue full, or no worker for it yet) is sent again this many times, after
# its Retry-After (at most MAX_RETRY_WAIT_S) or, without one (plain `torchserve`), after
# FIRST_BACKOFF_S doubled at each try: 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s, about 3 s in all.
MAX_503_RETRIES = 5
FIRST_BACKOFF_S = 0.1
MAX_RETRY_WAIT_S = 30.0
# The first characters of every line AnswerLog writes (PredictionLine.to_json).
ANSWER_LINE_START = b'{"path":'


class PredictError(CommandError):
    """The images cannot be sent: the server, the key or the model is not as needed; or the
    answers cannot be written."""


@dataclass(frozen=True)
class ServedModel:
    """What the management API says of the model's version that answers (None: not asked)."""

    version: str | None
    ready_workers: int | None
    batch_size: int | None
    queue_size: int | None = None

    def default_concurrency(self) -> int:
        """IN_FLIGHT_PER_BATCH_SLOT x workers x batch size, but no more than the model holds:
        its queue plus a batch at each worker."""
        if not (self.ready_workers and self.batch_size):
            return DEFAULT_CONCURRENCY
        in_batches = self.ready_workers * self.batch_size
        wanted = IN_FLIGHT_PER_BATCH_SLOT * in_batches
        if self.queue_size is not None:
            wanted = min(wanted, self.queue_size + in_batches)
        return max(wanted, 1)


@dataclass(frozen=True)
class PredictionLine:
    """One image's outcome: `status` 0 when no HTTP answer came; `error` says why an image was
    not answered, or why its answer could not be used (a drawing that could not be written:
    then both are there)."""

    path: str
    status: int
    latency_ms: float
    answer: Any = None
    error: Any = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def to_json(self) -> str:
        line: dict[str, Any] = {"path": self.path, "status": self.status,
                                "latency_ms": round(self.latency_ms, 2)}
        if self.status == 200:
            line["answer"] = self.answer
        if self.error is not None:
            line["error"] = self.error
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
    return ServedModel(served_version, ready, int(chosen.get("batchSize") or 1), queue_size(chosen))


def queue_size(described: dict[str, Any]) -> int | None:
    """The version's queue size from describe's jobQueueStatus (free + pending), None without it."""
    status = described.get("jobQueueStatus")
    if not isinstance(status, dict) or "remainingCapacity" not in status:
        return None
    return int(status["remainingCapacity"]) + int(status.get("pendingRequests", 0))


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
    """The JSON-lines answers file (or standard output); `write_text` writes each line instead
    when given (through the progress bar, when both share a terminal)."""

    def __init__(self, stream: IO[str], write_text: Callable[[str], None] | None = None) -> None:
        self.stream = stream
        self.write_text = write_text
        self.lock = threading.Lock()

    def write(self, line: PredictionLine) -> None:
        text = line.to_json()
        with self.lock:
            if self.write_text is not None:
                self.write_text(text)
                return
            self.stream.write(text + "\n")
            self.stream.flush()


def answered_paths(path: Path) -> set[str]:
    """The paths whose last line in an answers file has status 200 and no error (none when the
    file does not exist). PredictError, before anything is changed, when the file is not an
    answers file; then a partial last line (no newline: a run killed while writing it) is cut."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    partial = data[len(complete):]
    last: dict[str, bool] = {}
    for number, raw in enumerate(complete.decode("utf-8", "replace").splitlines(), start=1):
        line = answer_line(raw)
        if line is None:
            raise PredictError(f"{path}, line {number}: not an answer line of `predict --out` "
                               "(give another --out, or remove the file)")
        last[line["path"]] = line["status"] == 200 and "error" not in line
    if partial and not ANSWER_LINE_START.startswith(partial[: len(ANSWER_LINE_START)]):
        raise PredictError(f"{path} does not end as an answers file of `predict --out` does "
                           "(give another --out, or remove the file)")
    if partial:
        with open(path, "r+b") as file:
            file.truncate(len(complete))
    return {key for key, answered in last.items() if answered}


def answer_line(raw: str) -> dict[str, Any] | None:
    """One line of an answers file as a dict with a string `path` and an int `status`, else None."""
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    if isinstance(line, dict) and isinstance(line.get("path"), str) and isinstance(line.get("status"), int):
        return line
    return None


@dataclass
class RunCounts:
    """The images of a run: `total` to send, `answered` and `failed` of them (every image that
    got a line), `retried` 503s sent again."""

    total: int = 0
    answered: int = 0
    failed: int = 0
    retried: int = 0
    started_s: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> int:
        return self.answered + self.failed

    @property
    def not_done(self) -> int:
        return self.total - self.done

    def images_per_s(self) -> float:
        return self.done / max(time.perf_counter() - self.started_s, 1e-9)


@dataclass
class SendingThread:
    """A sending thread's own connection and the key generation it carries."""

    connection: KeepAliveConnection
    generation: int


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
        self.count_lock = threading.Lock()
        self.fatal_lock = threading.Lock()
        self.key_generation = 0
        self.key_refreshed_s = 0.0
        self.fatal: PredictError | None = None
        self.stopped = threading.Event()
        self.threads = threading.local()
        self.counts = RunCounts()

    def run(self, images: Sequence[ImageInput], sink: Callable[[PredictionLine], None],
            complete: Callable[[ImageInput, PredictionLine], None] | None = None,
            progress: Callable[[RunCounts], None] | None = None) -> RunCounts:
        """Send every image; for each answered one call `complete(image, line)` (e.g. its
        drawing; an exception makes the line a failed one), then `sink(line)` (its line written;
        an exception stops the run). Both are called in the sending threads, as each image
        finishes. Raises the run's PredictError, if any, once the requests in flight have ended;
        `counts` then says how many images were left undone."""
        self.counts = RunCounts(total=len(images))
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(images))),
                                thread_name_prefix="predict") as pool:
            futures = [pool.submit(self.handle, image, sink, complete, progress) for image in images]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                self.stop(PredictError("interrupted"))
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        if self.fatal is not None:
            raise self.fatal
        return self.counts

    def handle(self, image: ImageInput, sink: Callable[[PredictionLine], None],
               complete: Callable[[ImageInput, PredictionLine], None] | None,
               progress: Callable[[RunCounts], None] | None) -> None:
        """One image from sending to its line; never raises (see `run`)."""
        if self.stopped.is_set():
            return
        line: PredictionLine | None = None
        try:
            line = self.answered(image)
            if line is None:                    # the run stopped while it was being sent
                return
            if complete is not None and line.ok:
                complete(image, line)
        except Exception as error:  # noqa: BLE001 - one image's failure is its own line
            line = failed_line(image, line, error)
        try:
            sink(line)
        except Exception as error:  # noqa: BLE001 - a line that cannot be written stops the run
            failure = PredictError(f"cannot write the answer line of {image.key} ({describe_error(error)}); "
                                   "stopped")
            failure.__cause__ = error
            self.stop(failure)
            return
        with self.count_lock:
            if line.ok:
                self.counts.answered += 1
            else:
                self.counts.failed += 1
            if progress is not None:
                progress(self.counts)

    def thread(self) -> SendingThread:
        """This sending thread's connection (made on first use, and again for a newer key)."""
        current: SendingThread | None = getattr(self.threads, "current", None)
        if current is None or current.generation < self.key_generation:
            if current is not None:
                current.connection.close()
            current = SendingThread(self.connection(), self.key_generation)
            self.threads.current = current
        return current

    def answered(self, image: ImageInput) -> PredictionLine | None:
        """The image's line after the retries of 503 and refused keys; None once the run stops."""
        for attempt in range(MAX_503_RETRIES + 1):
            sending = self.thread()
            line = self.send(sending.connection, sending.generation, image)
            if line is None and self.fatal is None:     # the key was refreshed: once more
                sending = self.thread()
                line = self.send(sending.connection, sending.generation, image)
            if line is None:
                self.stop(PredictError(key_hint(self.client)))
                return None
            if line.status != 503 or attempt == MAX_503_RETRIES:
                return line
            if self.stopped.wait(retry_wait_s(sending.connection.last_retry_after_s, attempt)):
                return None
            with self.count_lock:
                self.counts.retried += 1
        raise AssertionError("unreachable")

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
        """End the run with `error` (the first such error wins): no image is sent after it."""
        with self.fatal_lock:
            if self.fatal is None:
                self.fatal = error
        self.stopped.set()


def retry_wait_s(retry_after_s: float | None, attempt: int) -> float:
    """How long to wait before sending a 503's image again: its Retry-After (at most
    MAX_RETRY_WAIT_S), else FIRST_BACKOFF_S doubled `attempt` times."""
    if retry_after_s is not None:
        return min(retry_after_s, MAX_RETRY_WAIT_S)
    return FIRST_BACKOFF_S * 2 ** attempt


def failed_line(image: ImageInput, line: PredictionLine | None, error: Exception) -> PredictionLine:
    """`image`'s line after `error` while handling it: its answer kept when it had one."""
    message = {"message": f"{describe_error(error)}"}
    if line is None:
        return PredictionLine(image.key, 0, 0.0, error=message)
    return PredictionLine(line.path, line.status, line.latency_ms, line.answer, error=message)


def describe_error(error: BaseException) -> str:
    """An error in a line's words: a CommandError's message as it is, another with its type."""
    if isinstance(error, CommandError):
        return str(error)
    text = getattr(error, "strerror", None) or str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def parsed_body(body: bytes) -> Any:
    """An answer's JSON, or its text when it is not JSON."""
    try:
        return json.loads(body)
    except ValueError:
        return {"message": body.decode("utf-8", "replace").strip()}
