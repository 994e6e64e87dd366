"""Sampled payloads for the improvement loop: an opt-in, rate-limited sample of the requests a
worker computed (the image, its answer, model, version, time), written off the request path for
an operator to collect and label.

Turned on per deployment by the environment (read once, when the worker loads):

- `TSV_SAMPLE_DIR`: a directory; each sample is two files under `<dir>/<model>/<version>/`:
  `<UTC time>-<sha256 prefix>.<jpg|png|...>` (the bytes as received) and `.json` beside it
  (model, version, time, the image's SHA-256 and format, the answer). Or `-`: one JSON line per
  sample on standard output (pods: the log collector takes it), without the image, only its
  SHA-256.
- `TSV_SAMPLE_PER_S`: samples a worker writes per second at most (default 1; a token bucket
  with a burst of one second's worth).
- `TSV_SAMPLE_MAX_BYTES`: the bound on what the directory keeps per model version (default
  256 MiB): beyond it the oldest samples are deleted (rotation), whichever worker wrote them.

`offer` runs after a batch's answers are computed, in the request thread, and only draws
against the rate and puts a copy on a bounded queue without waiting (a full queue drops the
sample); a daemon thread writes. A failed write (disk full, no permission) drops the sample,
is counted and logged at most once a minute: it never fails or slows a request.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from handlers.batch.batch_record import BatchRecord
from handlers.batch.batch_stage import BatchStage
from handlers.batch.request_slot import RequestSlot, computed_images
from handlers.drift.drift_metrics import emit_payload_samples
from handlers.ground.limits import SettingsError

logger = logging.getLogger(__name__)

DIRECTORY_ENVIRONMENT = "TSV_SAMPLE_DIR"
RATE_ENVIRONMENT = "TSV_SAMPLE_PER_S"
MAX_BYTES_ENVIRONMENT = "TSV_SAMPLE_MAX_BYTES"
STANDARD_OUTPUT = "-"
QUEUE_SIZE = 64
ERROR_LOG_INTERVAL_S = 60.0
RESCAN_S = 10.0
SUFFIXES = {b"\xff\xd8": "jpg", b"\x89P": "png", b"RI": "webp", b"BM": "bmp", b"GI": "gif",
            b"II": "tiff", b"MM": "tiff"}


@dataclass(frozen=True)
class SampleSettings:
    directory: Path | None          # None: JSON lines on standard output
    per_second: float = 1.0
    max_bytes: int = 256 * 1024 * 1024


def sample_settings(environment: Mapping[str, str]) -> SampleSettings | None:
    """The deployment's sampling (None: off); SettingsError naming a malformed variable."""
    target = environment.get(DIRECTORY_ENVIRONMENT, "").strip()
    if not target:
        return None
    try:
        per_second = float(environment.get(RATE_ENVIRONMENT, "1"))
        max_bytes = int(environment.get(MAX_BYTES_ENVIRONMENT, str(SampleSettings.max_bytes)))
    except ValueError as error:
        raise SettingsError(f"{RATE_ENVIRONMENT} / {MAX_BYTES_ENVIRONMENT}: {error}") from None
    if not per_second > 0 or max_bytes <= 0:
        raise SettingsError(f"{RATE_ENVIRONMENT} and {MAX_BYTES_ENVIRONMENT} must be above 0")
    return SampleSettings(None if target == STANDARD_OUTPUT else Path(target), per_second, max_bytes)


@dataclass(frozen=True)
class PayloadSample:
    model: str
    version: str
    time_s: float
    image: bytes
    answer: Any

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.image).hexdigest()

    @property
    def suffix(self) -> str:
        return SUFFIXES.get(self.image[:2], "bin")

    def record(self) -> dict[str, Any]:
        """Everything but the image bytes."""
        return {"model": self.model, "version": self.version,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time_s)),
                "sha256": self.sha256, "format": self.suffix, "answer": self.answer}


class TokenBucket:
    """At most `per_second` on average, a burst of one second's worth (at least one)."""

    def __init__(self, per_second: float, clock: Callable[[], float]) -> None:
        self.per_second, self.clock = per_second, clock
        self.capacity = max(1.0, per_second)
        self.tokens, self.last = self.capacity, clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.per_second)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class SampleDirectory:
    """The samples of one model version under `<root>/<model>/<version>/`, kept under
    `max_bytes` by deleting the oldest (names start with the UTC time, so name order is age
    order). Every worker of the version on the host writes there: what is on disk is read again
    every RESCAN_S, so the bound holds for all of them together (give or take the samples of
    that interval)."""

    def __init__(self, root: Path, model: str, version: str, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.folder = root / model / version
        self.max_bytes = max_bytes
        self.clock = clock
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sizes: dict[str, int] = {}
        self.total = 0
        self.scanned_at = -RESCAN_S
        self.rescan()

    def rescan(self) -> None:
        self.sizes = {}
        for path in self.folder.iterdir():
            with contextlib.suppress(FileNotFoundError):     # another worker's rotation
                self.sizes[path.name] = path.stat().st_size
        self.total = sum(self.sizes.values())
        self.scanned_at = self.clock()

    def write(self, sample: PayloadSample) -> None:
        stem = (time.strftime("%Y%m%dT%H%M%S", time.gmtime(sample.time_s))
                + f"{sample.time_s % 1:.6f}"[2:] + f"-{sample.sha256[:16]}")   # no dot: one stem
        for name, content in ((f"{stem}.{sample.suffix}", sample.image),
                              (f"{stem}.json", json.dumps(sample.record()).encode())):
            (self.folder / name).write_bytes(content)
            self.total += len(content) - self.sizes.get(name, 0)
            self.sizes[name] = len(content)
        if self.clock() - self.scanned_at >= RESCAN_S:
            self.rescan()
        if self.total > self.max_bytes:
            self.rotate()

    def rotate(self) -> None:
        """Delete whole samples (image and record), oldest first, until within the bound."""
        for stem in sorted({name.split(".")[0] for name in self.sizes}):
            if self.total <= self.max_bytes:
                return
            for name in [name for name in self.sizes if name.split(".")[0] == stem]:
                (self.folder / name).unlink(missing_ok=True)
                self.total -= self.sizes.pop(name)


class PayloadSampler(BatchStage):
    """See the module docstring. `outcomes` counts offered samples by what became of them:
    written, rate_limited, queue_full, write_failed."""

    name = "PayloadSamples"

    def __init__(self, model: str, version: str, settings: SampleSettings,
                 clock: Callable[[], float] = time.time, output: TextIO | None = None) -> None:
        self.model, self.version, self.settings = model, version, settings
        self.clock = clock
        self.bucket = TokenBucket(settings.per_second, time.monotonic)
        self.output = output
        self.outcomes: Counter[str] = Counter()
        self.exported: Counter[str] = Counter()
        self.pending: queue.Queue[PayloadSample] = queue.Queue(maxsize=QUEUE_SIZE)
        self.directory: SampleDirectory | None = None
        self.last_error_log = -ERROR_LOG_INTERVAL_S
        self.writer = threading.Thread(target=self.write_forever, daemon=True,
                                       name=f"payload samples {model} {version}")
        self.writer.start()

    def answered(self, slots: Sequence[RequestSlot], computed: Sequence[RequestSlot],
                 record: BatchRecord, metrics: Any) -> None:
        self.offer(computed, metrics)

    def offer(self, slots: Sequence[RequestSlot], metrics: Any = None) -> None:
        """Draw the answered, decoded requests of `slots` against the rate; queue those drawn.
        The outcomes since the last call go out as HandlerPayloadSamples{Outcome} counters."""
        for image, _, _, answer in computed_images(slots):
            if not self.bucket.take():
                self.outcomes["rate_limited"] += 1
                continue
            try:
                self.pending.put_nowait(PayloadSample(self.model, self.version, self.clock(),
                                                      bytes(image), answer))
            except queue.Full:
                self.outcomes["queue_full"] += 1
        outcomes = Counter(self.outcomes)     # a copy: the writer thread adds to it
        emit_payload_samples(metrics, self.model, self.version, outcomes - self.exported)
        self.exported = outcomes

    def write_forever(self) -> None:
        while True:
            sample = self.pending.get()
            try:
                self.write(sample)
                self.outcomes["written"] += 1
            except OSError as error:       # disk full, permissions: the sample is dropped
                self.outcomes["write_failed"] += 1
                if time.monotonic() - self.last_error_log >= ERROR_LOG_INTERVAL_S:
                    self.last_error_log = time.monotonic()
                    logger.warning("payload sample not written (%d so far): %s",
                                   self.outcomes["write_failed"], error)
            finally:
                self.pending.task_done()

    def write(self, sample: PayloadSample) -> None:
        if self.settings.directory is None:
            stream = self.output or sys.stdout
            stream.write(json.dumps({"payload_sample": sample.record()}) + "\n")
            stream.flush()
            return
        if self.directory is None:
            self.directory = SampleDirectory(self.settings.directory, self.model, self.version,
                                             self.settings.max_bytes)
        self.directory.write(sample)


def payload_sampler_for(model: str, version: str,
                        environment: Mapping[str, str] = os.environ) -> PayloadSampler | None:
    """The worker's sampler when the deployment turned sampling on (see the module docstring)."""
    settings = sample_settings(environment)
    return None if settings is None else PayloadSampler(model, version, settings)
