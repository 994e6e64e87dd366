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
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import psutil
import torch

from handlers.batch_record import STAGES, BatchRecord
from handlers.batching import decode_each, merge_outcomes
from handlers.compiled_model import CompiledModelRefused, RunnerKind
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
from handlers.settings import parse_log_batches, parse_torch_threads

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
ModelInput = TypeVar("ModelInput")
ModelOutput = TypeVar("ModelOutput")
Settings = TypeVar("Settings")  # a model's HandlerSettings, or a pipeline's settings
HeaderReader = Callable[[str], "str | None"]
JSON_CONTENT_TYPE = "application/json"
BATCH_SIZE_HEADER = "X-Batch-Size"


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
        self.runner: RunnerKind = "eager"        # "aot" once `load` accepts a compiled package
        self.compiled_refusal: CompiledModelRefused | None = None  # why a package was refused

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
            "warm_up_ms=%.0f startup_ms=%.0f",
            self.model_name, self.model_version, self.device, self.runner, self.max_batch_size,
            (warm_up_started - load_started) * 1000, (ready - warm_up_started) * 1000,
            worker_process_age_ms(),
        )
        if self.compiled_refusal is not None:
            emit_compiled_model_refusal(getattr(context, "metrics", None), self.compiled_refusal)
        self.initialized = True

    def handle(self, data: Sequence[Mapping[str, Any]], context: TorchServeContext) -> list[bytes]:
        """One JSON body per request, in order; statuses set per request on `context`. A request
        in the Open Inference Protocol's form is answered in that form (see inference_protocol)."""
        record = BatchRecord(self.model_name, self.model_version, size=len(data), runner=self.runner)
        v2_requests: dict[int, V2Request] = {}

        def decode(index: int) -> Item:
            row = data[index]
            if is_v2_request(row.get("body")):
                v2_requests[index] = V2Request(None)
                row, v2_requests[index] = v2_to_row(row["body"])
            return self.decode_request(row, lambda name: context.get_request_header(index, name))

        with record.timing("decode"):
            decoded = decode_each(len(data), decode)
        answers: list[Any] = []
        if decoded.items:
            with torch.inference_mode():
                answers = self.answer_items(decoded.items, record)
        outcomes = merge_outcomes(len(data), decoded.indices, answers, decoded.errors)
        record.answered = len(answers)
        if answers:
            self.record_answers(record, answers)
        record.rejected.update(error.error_type for error in decoded.errors.values())
        if self.log_batches:
            logger.info(record.to_log_line())
        emit_batch_metrics(getattr(context, "metrics", None), record)
        return [
            self.write_response(context, index, outcome, len(data), v2_requests.get(index))
            for index, outcome in enumerate(outcomes)
        ]

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
        `runner` / `compiled_refusal` when a compiled package is involved."""

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

    def answer_headers(self, answer: Any) -> Mapping[str, str]:
        """Response headers of one successful answer (default: none)."""
        return {}

    # --- helpers --------------------------------------------------------------------------
    def write_response(self, context: TorchServeContext, index: int, outcome: Any, batch_size: int,
                       v2_request: V2Request | None = None) -> bytes:
        context.set_response_content_type(index, JSON_CONTENT_TYPE)
        context.set_response_header(index, BATCH_SIZE_HEADER, str(batch_size))
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
