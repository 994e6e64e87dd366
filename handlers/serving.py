"""The one TorchServe-facing class: the batch contract, per-request statuses, timing, warm-up.

Subclasses implement small hooks, each with one job:
`parse_settings(handler_section)` and `load(handler_section, serialized_file)` once ->
`decode_request(row, header)` per request -> `preprocess(items)` -> `infer(model_input)` ->
`postprocess(model_output, model_input, items)`.
`handle` guarantees one answer per request: a ClientError gets that request a 4xx JSON body,
everything else in the batch is answered normally. Anything else raised is a server fault and
fails the batch, as TorchServe reports it (503, or 507 for CUDA errors).

Typed against the small `TorchServeContext` protocol, not `ts.context.Context`; the one import
from TorchServe (metric types) happens only when a metrics cache is there to receive metrics.
"""

from __future__ import annotations

import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import psutil
import torch

from handlers.batch_record import STAGES, BatchRecord
from handlers.batching import decode_each, merge_outcomes
from handlers.cache_settings import parse_cache_section, with_environment
from handlers.compiled_model import CompiledModelRefused, RunnerChoice, RunnerKind
from handlers.errors import ClientError
from handlers.inference_protocol import (
    TensorOutput,
    V2Request,
    is_v2_request,
    v2_error,
    v2_response,
    v2_to_row,
)
from handlers.model_loading import resolve_device
from handlers.perceptual_hash import perceptual_hash
from handlers.response_cache import ResponseCache, cache_key, namespace_of
from handlers.settings import parse_log_batches, parse_torch_threads

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
ModelInput = TypeVar("ModelInput")
ModelOutput = TypeVar("ModelOutput")
Settings = TypeVar("Settings")  # a model's HandlerSettings, or a pipeline's settings
HeaderReader = Callable[[str], "str | None"]
JSON_CONTENT_TYPE = "application/json"
DESCRIBE_HEADER = "describe"   # TorchServe's `GET /models/{m}?customized=true` sends "True"
BATCH_SIZE_HEADER = "X-Batch-Size"
CACHE_HEADER = "X-Cache"   # hit | near-hit | miss | bypass, when the model has a response cache
CACHE_HIT, CACHE_NEAR_HIT, CACHE_MISS, CACHE_BYPASS = "hit", "near-hit", "miss", "bypass"


def bypasses_cache(header: HeaderReader) -> bool:
    """`Cache-Control: no-cache` (or no-store): neither read nor write the cache for this request."""
    directives = (header("Cache-Control") or "").lower()
    return "no-cache" in directives or "no-store" in directives


@dataclass
class CacheLookup:
    """One batch's cache work: keys of the requests that have one, hits (decoded answers) and
    each request's status for the X-Cache header."""

    keys: dict[int, str] = field(default_factory=dict)
    options: dict[int, str] = field(default_factory=dict)     # canonical options text
    near_keys: dict[int, str] = field(default_factory=dict)   # perceptual-hash keys
    hits: dict[int, Any] = field(default_factory=dict)
    status: dict[int, str] = field(default_factory=dict)


def emit_batch_metrics(metrics: Any, record: BatchRecord) -> None:
    """Export a batch's record through TorchServe's metrics cache (Prometheus with
    metrics_mode=prometheus and model_metrics_auto_detect=true). No-op without a cache."""
    if metrics is None:
        return
    from ts.metrics.metric_type_enum import MetricTypes  # the glue's only TorchServe import

    metrics.add_metric("HandlerBatchSize", record.size, "count", metric_type=MetricTypes.GAUGE)
    metrics.add_metric("HandlerCompiledModel", int(record.runner == "aot"), "count",
                       metric_type=MetricTypes.GAUGE)
    metrics.add_counter("HandlerBatches", 1)
    metrics.add_counter("HandlerRequests", record.size)
    for stage in STAGES:
        metrics.add_metric(f"Handler{stage.capitalize()}Ms", round(record.stage_ms[stage], 3), "ms",
                           metric_type=MetricTypes.GAUGE)
    for reason, count in record.rejected.items():
        metrics.add_counter("HandlerRejectedRequests", count, dimensions=[MetricDimension("Reason", reason)])
    if record.oom_splits:
        metrics.add_counter("HandlerOutOfMemorySplits", record.oom_splits)
    for name, count in record.counters.items():
        metrics.add_counter(f"Handler{name}", count)
    for name, value in record.gauges.items():
        metrics.add_metric(f"Handler{name}", value, "count", metric_type=MetricTypes.GAUGE)


def emit_compiled_model_refusal(metrics: Any, refusal: CompiledModelRefused) -> None:
    """Count a worker that serves eagerly because its compiled package was refused."""
    if metrics is not None:
        metrics.add_counter("HandlerCompiledModelRefusals", 1,
                            dimensions=[MetricDimension("Reason", refusal.kind)])


@dataclass(frozen=True)
class MetricDimension:
    """A metric dimension, shaped like `ts.metrics.dimension.Dimension` (name, value)."""

    name: str
    value: str


def is_describe_request(data: Sequence[Mapping[str, Any]], context: TorchServeContext) -> bool:
    """TorchServe's describe job (`?customized=true`): alone in its batch, no payload, header
    `describe: True`. A client's request that carries the header with an image is predicted as
    usual, and one request's header never decides for a batch of several."""
    return (len(data) == 1 and not any(data[0].values())
            and context.get_request_header(0, DESCRIBE_HEADER) == "True")


def required_serialized_file(serialized_file: str | None) -> str:
    """The manifest's serialized file name; ValueError for an archive built without one."""
    if serialized_file is None:
        raise ValueError("the archive has no serialized model file (--serialized-file)")
    return serialized_file


def worker_process_age_ms() -> float:
    """Milliseconds since this process started: a worker's start-up time when it is ready
    (Python and torch imports, model load, warm-up)."""
    return (time.time() - psutil.Process().create_time()) * 1000


class TorchServeContext(Protocol):
    """The parts of `ts.context.Context` the handlers use."""

    manifest: dict[str, Any]
    model_yaml_config: dict[str, Any] | None

    @property
    def system_properties(self) -> dict[str, Any]: ...

    def get_request_header(self, idx: int, key: str) -> str | None: ...

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None: ...

    def set_response_content_type(self, idx: int, value: str) -> None: ...

    def set_response_header(self, idx: int, key: str, value: str) -> None: ...


class BatchedImageHandler(ABC, Generic[Item, ModelInput, ModelOutput, Settings]):
    """Template for a batched handler; see the module docstring for the hook order."""

    settings: Settings
    labels: list[str]
    precision: str      # what runs here: settings.precision where this device supports it, else fp32

    def __init__(self) -> None:
        self.initialized = False
        self.device = torch.device("cpu")
        self.model_dir = Path(".")
        self.model_name = "model"
        self.model_version = "0"
        self.max_batch_size = 1
        self.log_batches = True
        # What serves each network with compiled packages ("classifier", or a pipeline's stage
        # roles), set by `load`: a package, or eager and why.
        self.runners: dict[str, RunnerChoice] = {}
        self.cache: ResponseCache | None = None  # with `handler.cache` (or TSV_CACHE=on)
        self.cache_namespace = ""

    # --- TorchServe entry points -------------------------------------------------------
    def initialize(self, context: TorchServeContext) -> None:
        properties = context.system_properties
        self.model_dir = Path(properties["model_dir"])
        self.device = resolve_device(properties.get("gpu_id"))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        model_manifest = (context.manifest or {}).get("model", {})
        self.model_name = model_manifest.get("modelName", self.model_name)
        self.model_version = model_manifest.get("modelVersion", self.model_version)
        self.max_batch_size = int(properties.get("batch_size") or 1)
        handler_settings = (context.model_yaml_config or {}).get("handler", {})
        self.log_batches = parse_log_batches(handler_settings)
        threads = parse_torch_threads(handler_settings)
        if threads is not None:
            torch.set_num_threads(threads)
        load_started = time.perf_counter()
        self.load(handler_settings, model_manifest.get("serializedFile"))
        warm_up_started = time.perf_counter()
        self.warm_up(self.max_batch_size)
        ready = time.perf_counter()
        logger.info(
            "worker ready model=%s version=%s device=%s runner=%s max_batch_size=%d load_ms=%.0f "
            "warm_up_ms=%.0f startup_ms=%.0f runners=%s",
            self.model_name, self.model_version, self.device, self.runner, self.max_batch_size,
            (warm_up_started - load_started) * 1000, (ready - warm_up_started) * 1000,
            worker_process_age_ms(), json.dumps(self.describe()["runners"], sort_keys=True),
        )
        for refusal in self.compiled_refusals:
            emit_compiled_model_refusal(getattr(context, "metrics", None), refusal)
        cache_settings = with_environment(parse_cache_section(handler_settings.get("cache")),
                                          os.environ)
        if cache_settings.enabled:
            self.cache = ResponseCache(cache_settings)
            self.cache_namespace = namespace_of(self.model_name, self.model_version, handler_settings)
            logger.info("response cache on: memory_bytes=%d redis=%s ttl_s=%d",
                        cache_settings.memory_bytes, cache_settings.redis_url or "none",
                        cache_settings.ttl_s)
        self.initialized = True

    @property
    def runner(self) -> RunnerKind:
        """"aot" when every network with compiled packages serves one, else "eager"."""
        kinds = {choice.kind for choice in self.runners.values()}
        return "aot" if kinds == {"aot"} else "eager"

    @property
    def compiled_refusals(self) -> list[CompiledModelRefused]:
        return [choice.refusal for choice in self.runners.values() if choice.refusal is not None]

    def describe(self) -> dict[str, Any]:
        """This worker's answer to `GET /models/{m}/{v}?customized=true` (TorchServe shows it as
        `customizedMetadata`): device, precision, batch bound, and the runner of each network."""
        return {"device": str(self.device), "precision": self.precision,
                "max_batch_size": self.max_batch_size, "runner": self.runner,
                "runners": {role: choice.describe() for role, choice in self.runners.items()}}

    def handle(self, data: Sequence[Mapping[str, Any]], context: TorchServeContext) -> list[bytes]:
        """One JSON body per request, in order; statuses set per request on `context`. A request
        in the Open Inference Protocol's form is answered in that form (see inference_protocol).
        With a response cache, hits are answered without decoding or inference (see
        `handlers.response_cache`); the rest of the batch runs as usual. TorchServe's describe
        job (see `is_describe_request`) gets `describe()`."""
        if is_describe_request(data, context):
            return [json.dumps(self.describe()).encode("utf-8")]
        record = BatchRecord(self.model_name, self.model_version, size=len(data), runner=self.runner)
        rows: list[Mapping[str, Any]] = []
        v2_requests: dict[int, V2Request] = {}
        errors: dict[int, ClientError] = {}   # refused requests, by batch position
        for index, row in enumerate(data):
            if is_v2_request(row.get("body")):
                v2_requests[index] = V2Request(None)
                try:
                    row, v2_requests[index] = v2_to_row(row["body"])
                except ClientError as error:
                    errors[index] = error
            rows.append(row)

        def header_of(index: int) -> HeaderReader:
            return lambda name: context.get_request_header(index, name)

        lookup = self.look_up_cached(rows, header_of, errors, record)
        pending = [index for index in range(len(rows)) if index not in lookup.hits and index not in errors]
        with record.timing("decode"):
            decoded = decode_each(len(pending), lambda position: self.decode_request(
                rows[pending[position]], header_of(pending[position])))
        errors.update({pending[position]: error for position, error in decoded.errors.items()})
        decoded_items = {pending[position]: item
                         for position, item in zip(decoded.indices, decoded.items, strict=True)}
        self.look_up_near_duplicates(lookup, decoded_items, record)
        computed = [index for index in decoded_items if index not in lookup.hits]
        answers: list[Any] = []
        if computed:
            with torch.inference_mode():
                answers = self.answer_items([decoded_items[index] for index in computed], record)
        self.store_computed(lookup, computed, answers)
        if self.cache is not None:
            record.counters.update({f"Cache{name}": count
                                    for name, count in self.cache.take_counts().items()})
            record.gauges["CacheMemoryBytes"] = self.cache.memory_bytes
        outcomes = merge_outcomes(len(rows), [*computed, *lookup.hits],
                                  [*answers, *lookup.hits.values()], errors)
        record.answered = len(answers) + len(lookup.hits)
        if answers:
            self.record_answers(record, answers)
        record.rejected.update(error.error_type for error in errors.values())
        if self.log_batches:
            logger.info(record.to_log_line())
        emit_batch_metrics(getattr(context, "metrics", None), record)
        return [
            self.write_response(context, index, outcome, len(data), v2_requests.get(index),
                                lookup.status.get(index))
            for index, outcome in enumerate(outcomes)
        ]

    def look_up_cached(self, rows: Sequence[Mapping[str, Any]],
                       header_of: Callable[[int], HeaderReader], refused: Mapping[int, ClientError],
                       record: BatchRecord) -> CacheLookup:
        """The batch's cache keys, statuses and hits (decoded answers), in one lookup."""
        lookup = CacheLookup()
        if self.cache is None:
            return lookup
        with record.timing("cache"):
            for index, row in enumerate(rows):
                if index in refused:
                    continue
                if bypasses_cache(header_of(index)):
                    lookup.status[index] = CACHE_BYPASS
                    continue
                lookup.status[index] = CACHE_MISS
                try:
                    material = self.cache_key_material(row, header_of(index))
                except ClientError:
                    continue  # decoding reports it
                if material is not None:
                    lookup.keys[index] = cache_key(self.cache_namespace, material[1], material[0])
                    lookup.options[index] = material[1]
            found = self.cache.lookup(list(lookup.keys.values()))
            for index, key in lookup.keys.items():
                if key in found:
                    lookup.hits[index] = json.loads(found[key])
                    lookup.status[index] = CACHE_HIT
        record.counters["CacheBypasses"] = sum(s == CACHE_BYPASS for s in lookup.status.values())
        record.counters["CacheMisses"] = len(lookup.keys) - len(lookup.hits)
        return lookup

    def look_up_near_duplicates(self, lookup: CacheLookup, decoded_items: Mapping[int, Item],
                                record: BatchRecord) -> None:
        """With `near_duplicates` on: a second key per decoded request (its perceptual hash, see
        handlers.perceptual_hash), looked up in one go; hits join `lookup.hits`."""
        if self.cache is None or not self.cache.near_duplicates:
            return
        with record.timing("cache"):
            for index, item in decoded_items.items():
                image = self.near_duplicate_image(item)
                if image is not None and index in lookup.options:
                    lookup.near_keys[index] = cache_key(self.cache_namespace,
                                                        lookup.options[index] + "|phash",
                                                        perceptual_hash(image))
            found = self.cache.lookup(list(lookup.near_keys.values()))
            for index, key in lookup.near_keys.items():
                if key in found:
                    lookup.hits[index] = json.loads(found[key])
                    lookup.status[index] = CACHE_NEAR_HIT
        record.counters["CacheNearDuplicateHits"] = sum(
            status == CACHE_NEAR_HIT for status in lookup.status.values())
        record.counters["CacheMisses"] -= record.counters["CacheNearDuplicateHits"]

    def store_computed(self, lookup: CacheLookup, computed: Sequence[int], answers: Sequence[Any]) -> None:
        """Store the successful answers of requests that had a key (one write per batch), under
        the exact key and, in near-duplicate mode, the perceptual one."""
        if self.cache is None:
            return
        entries: dict[str, bytes] = {}
        for index, answer in zip(computed, answers, strict=True):
            value = json.dumps(answer).encode()
            for keys in (lookup.keys, lookup.near_keys):
                if index in keys:
                    entries[keys[index]] = value
        self.cache.store(entries)

    def answer_items(self, items: Sequence[Item], record: BatchRecord) -> list[Any]:
        """preprocess -> infer -> postprocess over `items`; on CUDA out-of-memory, the items are
        split in halves and each half retried, down to single items (a single item that still
        does not fit fails the batch, as a server fault)."""
        try:
            with record.timing("preprocess"):
                model_input = self.preprocess(items)
            with record.timing("inference"):
                model_output = self.infer(model_input)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            with record.timing("postprocess"):
                return self.postprocess(model_output, model_input, items)
        except torch.cuda.OutOfMemoryError:
            if len(items) == 1:
                raise
        # Retried outside the except block, so the failed attempt's tensors are already freed.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        half = len(items) // 2
        record.oom_splits += 1
        logger.warning("out of memory on %d items; retrying as %d + %d", len(items), half,
                       len(items) - half)
        return self.answer_items(items[:half], record) + self.answer_items(items[half:], record)

    # --- hooks ----------------------------------------------------------------------------
    @abstractmethod
    def parse_settings(self, handler_section: Mapping[str, Any]) -> Settings:
        """The archive's `handler:` section -> this handler's settings (SettingsError if bad)."""

    @abstractmethod
    def load(self, handler_settings: Mapping[str, Any], serialized_file: str | None) -> None:
        """Parse the settings into `self.settings`; load the model(s) onto `self.device` (with
        `handlers.classifier_model` / `handlers.detector_model`); set `labels`, `precision`, and
        `runners` for the networks that have compiled packages."""

    @abstractmethod
    def decode_request(self, row: Mapping[str, Any], header: HeaderReader) -> Item:
        """One request's payload (and headers) -> an item to batch, or raise ClientError."""

    @abstractmethod
    def preprocess(self, items: Sequence[Item]) -> ModelInput:
        """The decoded items of the batch -> the model's batched input on `self.device`."""

    @abstractmethod
    def infer(self, model_input: ModelInput) -> ModelOutput:
        """One forward pass over the whole batch."""

    @abstractmethod
    def postprocess(self, model_output: ModelOutput, model_input: ModelInput,
                    items: Sequence[Item]) -> list[Any]:
        """The batch's output -> one JSON-serialisable answer per item, in order. `model_input` is
        what `preprocess` returned, with any geometry it recorded (e.g. letterbox parameters)."""

    @abstractmethod
    def warm_up(self, batch_size: int) -> None:
        """Run the model at the sizes requests will use, so no request pays first-call costs."""

    @abstractmethod
    def v2_outputs(self, answer: Any) -> list[TensorOutput]:
        """One request's answer (as `postprocess` gave it) as Open Inference Protocol tensors."""

    def record_answers(self, record: BatchRecord, answers: Sequence[Any]) -> None:
        """Add this handler's own counters / gauges for the batch's answers to `record`
        (exported as Handler<Name> metrics and in the batch log line; default: none)."""

    def cache_key_material(self, row: Mapping[str, Any],
                           header: HeaderReader) -> tuple[bytes, str] | None:
        """(image bytes, the request's answer-changing options as canonical text) for the
        response cache; None: this handler's answers are not cached. May raise ClientError."""
        return None

    def near_duplicate_image(self, item: Item) -> torch.Tensor | None:
        """The decoded image whose perceptual hash keys near-duplicates (default: none; the
        classifiers give theirs: near-duplicate mode is for classification only)."""
        return None

    def answer_headers(self, answer: Any) -> Mapping[str, str]:
        """Response headers of one successful answer (default: none)."""
        return {}

    # --- helpers --------------------------------------------------------------------------
    def write_response(self, context: TorchServeContext, index: int, outcome: Any, batch_size: int,
                       v2_request: V2Request | None = None, cache_status: str | None = None) -> bytes:
        context.set_response_content_type(index, JSON_CONTENT_TYPE)
        context.set_response_header(index, BATCH_SIZE_HEADER, str(batch_size))
        if cache_status is not None:
            context.set_response_header(index, CACHE_HEADER, cache_status)
        if isinstance(outcome, ClientError):
            context.set_response_status(outcome.status, outcome.phrase, index)
            body = v2_error(outcome) if v2_request is not None else None
            return json.dumps(body).encode("utf-8") if body is not None else outcome.to_json_bytes()
        for name, value in self.answer_headers(outcome).items():
            context.set_response_header(index, name, value)
        if v2_request is not None:
            outcome = v2_response(self.model_name, self.model_version, v2_request,
                                  self.v2_outputs(outcome))
        return json.dumps(outcome).encode("utf-8")
