"""The one TorchServe-facing class: the batch contract, per-request statuses, timing, warm-up.

`handle` runs one batch as a short sequence of steps over its requests, one `RequestSlot` each
(handlers.batch.request_slot): read the protocol (handlers.protocol_stage), parse (image bytes +
options, once), decode, answer (preprocess -> infer -> postprocess over the open requests),
respond. The optional stages (the response cache, drift counting, payload samples, the shadow)
plug in around those steps through the hooks of handlers.batch.batch_stage, from the one list
`stages`; a stage that fails never fails a request.

Subclasses implement small hooks, each with one job: `parse_settings(handler_section)` and
`load(serialized_file)` once -> `parse_options(row, header)` per request -> `preprocess(items)`
-> `infer(model_input)` -> `postprocess(model_output, model_input, items)`. `handle` guarantees
one answer per request: a ClientError gets that request a 4xx JSON body, everything else in the
batch is answered normally. Anything else raised is a server fault and fails the batch, as
TorchServe reports it (503, or 507 for CUDA errors).

Typed against the small `TorchServeContext` protocol, not `ts.context.Context`.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from handlers.batch.batch_record import BatchRecord
from handlers.batch.batch_stage import BatchStage
from handlers.batch.request_slot import HeaderReader, RequestSlot, open_slots
from handlers.batch_metrics import emit_batch_metrics, emit_runner_choice
from handlers.cache.cache_stage import CACHE_HEADER, CacheStage, cache_stage_for
from handlers.continuous_serving import ContinuousServing, continuous_batching_of
from handlers.drift.drift_features import Observation
from handlers.drift.drift_profile import read_profile
from handlers.drift.drift_stage import DriftStage
from handlers.drift.payload_samples import PayloadSampler, payload_sampler_for
from handlers.ground.decoded_requests import DecodedImage, ParsedRequest
from handlers.ground.errors import ClientError
from handlers.ground.limits import ImageLimits
from handlers.model.host_batches import host_batches, solo_eligible
from handlers.model.model_loading import resolve_device
from handlers.model.runner_selection import RunnerChoice
from handlers.model.settings import parse_log_batches, parse_torch_threads
from handlers.protocol_stage import ProtocolStage
from handlers.request import chroma_kernels
from handlers.request.decode import DecodeResult, decode_with_headers, warm_up_decoder
from handlers.request.image_header import ImageHeader
from handlers.request.inference_protocol import (
    IMAGE_INPUT_METADATA,
    OutputSpec,
    TensorOutput,
    output_metadata,
)
from handlers.request.jpeg_batches import JpegDecoder
from handlers.request.request_body import extract_images
from handlers.shadow.answer_comparison import AnswerComparison
from handlers.shadow.shadow_stage import ShadowStage, shadow_stage_for
from handlers.torchserve_context import (
    BATCH_SIZE_HEADER,
    JSON_CONTENT_TYPE,
    MODEL_VERSION_HEADER,
    TorchServeContext,
    batching_account,
    frontend_identity,
    header_reader,
    is_describe_request,
    required_serialized_file,
    worker_process_age_ms,
)

logger = logging.getLogger(__name__)

__all__ = ["BatchedImageHandler", "HeaderReader", "TorchServeContext", "required_serialized_file"]

Options = TypeVar("Options")   # a model kind's frozen request-options dataclass
ModelInput = TypeVar("ModelInput")
ModelOutput = TypeVar("ModelOutput")


class HasImageLimits(Protocol):
    """What the base class reads of any kind's settings."""

    @property
    def limits(self) -> ImageLimits: ...

    @property
    def jpeg_decoder(self) -> JpegDecoder: ...

    @property
    def cuda_preprocess_kernels(self) -> bool: ...


Settings = TypeVar("Settings", bound=HasImageLimits)


def run_stages(stages: Sequence[BatchStage], record: BatchRecord, hook: str,
               call: Callable[[BatchStage], None]) -> None:
    """`call` (one hook, named `hook`) on every stage in turn. A stage that raises never fails a
    request: it is logged and counted in `record` (`Handler<name>StageFailures`), and the batch
    goes on."""
    for stage in stages:
        try:
            call(stage)
        except Exception:   # see the docstring
            logger.exception("the %s stage failed at %s; the batch goes on without it", stage.name, hook)
            failures = f"{stage.name}StageFailures"
            record.counters[failures] = record.counters.get(failures, 0) + 1


class BatchedImageHandler(ABC, Generic[Options, ModelInput, ModelOutput, Settings]):
    """Template for a batched handler; see the module docstring for the stages and hooks. Items
    of a batch are `DecodedImage[Options]`."""

    settings: Settings
    labels: list[str]
    precision: str      # what runs here: settings.precision where this device supports it, else fp32
    option_fields: Collection[str] = frozenset()   # form fields that carry options, not the image

    def __init__(self) -> None:
        self.initialized = False
        self.device = torch.device("cpu")
        self.model_dir = Path(".")
        self.model_name = "model"
        self.model_version = "0"
        self.max_batch_size = 1
        self.log_batches = True
        self.batching: dict[str, Any] = {}     # how batches are gathered (batching_account)
        self.jpeg_draft_size: int | None = None   # set by `load` where JPEG draft decoding is on
        # When this worker last answered a batch (the next batch's BatchRecord.waited_ms).
        self.last_batch_answered: float | None = None
        # What serves each network with compiled packages ("classifier", or a pipeline's stage
        # roles), set by `load`: a package, or eager and why.
        self.runners: dict[str, RunnerChoice] = {}
        self.cache: CacheStage | None = None  # with `handler.cache` (or TSV_CACHE=on)
        # In TorchServe's asynchronous worker mode (`asyncCommunication: true`): see
        # handlers.continuous_serving.
        self.continuous: ContinuousServing | None = None
        # Copies of a share of the answered requests to a candidate version, when the server has
        # a traffic directory (handlers.shadow).
        self.shadow: ShadowStage | None = None
        # Every computed request counted into the drift buckets (handlers.drift), exported
        # against the archive's reference profile when it has one.
        self.drift: DriftStage | None = None
        # An opt-in, rate-limited sample of computed requests written for labelling
        # (handlers.drift.payload_samples; TSV_SAMPLE_DIR).
        self.payload_samples: PayloadSampler | None = None

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
        continuous = None
        if (context.model_yaml_config or {}).get("asyncCommunication"):
            continuous = continuous_batching_of(handler_settings, self.max_batch_size)
            self.max_batch_size = continuous.max_batch_size     # what warm-up and batches use
        self.log_batches = parse_log_batches(handler_settings)
        self.batching = batching_account(context.model_yaml_config)
        if self.batching["asked"] == "queued" and self.batching["frontend_agent"] is False:
            logger.warning("batching: the archive asks for queued batching, and this TorchServe "
                           "runs without the frontend agent: TorchServe's own ContinuousBatching "
                           "gathers the batches, waiting up to maxBatchDelay for company. Start "
                           "the server with `torchserve-vision server start`, or add the agent to "
                           "config.properties' vmargs (README, \"Starting TorchServe by hand\")")
        threads = parse_torch_threads(handler_settings)
        if threads is not None:
            torch.set_num_threads(threads)
        load_started = time.perf_counter()
        self.settings = self.parse_settings(handler_settings)
        self.load(model_manifest.get("serializedFile"))
        if not self.torch_computes() and torch.get_num_threads() > 1:
            # The engines compute on threads of their own and torch only preprocesses: its
            # OpenMP threads, spinning after each preprocess, would take the cores the engine's
            # threads need (OpenVINO bf16 at batch 1 on 2 threads: 6.5 ms against 3.2 ms).
            logger.info("torch threads 1: %s computes on its own threads", self.runner)
            torch.set_num_threads(1)
        if self.device.type == "cuda" and self.jpeg_draft_size is not None:
            logger.info("jpeg_draft: JPEGs with a short side of %d px or more are decoded on the "
                        "CPU at reduced scale, as on a CPU worker; an archive built with "
                        "--target gpu decodes them on the device", 2 * self.jpeg_draft_size)
        warm_up_started = time.perf_counter()
        self.warm_up(self.max_batch_size)
        if warm_up_decoder(self.settings.limits, self.device, self.settings.jpeg_decoder):
            logger.info("decoder: %s's batched JPEG decoder repeats 4:2:0 and 4:2:2 chroma; it is "
                        "interpolated after decoding as the CPU's libjpeg-turbo does", self.device)
            if self.settings.cuda_preprocess_kernels:
                chroma_kernels.warm_up(self.device)
        ready = time.perf_counter()
        logger.info(
            "worker ready model=%s version=%s device=%s runner=%s max_batch_size=%d load_ms=%.0f "
            "warm_up_ms=%.0f startup_ms=%.0f runners=%s",
            self.model_name, self.model_version, self.device, self.runner, self.max_batch_size,
            (warm_up_started - load_started) * 1000, (ready - warm_up_started) * 1000,
            worker_process_age_ms(), json.dumps(self.describe()["runners"], sort_keys=True),
        )
        for role, choice in self.runners.items():
            emit_runner_choice(context.metrics, role, choice)
        self.drift = DriftStage(self.model_name, self.model_version, read_profile(self.model_dir),
                                self.answer_observations)
        self.drift.export_reference(context.metrics)
        self.payload_samples = payload_sampler_for(self.model_name, self.model_version)
        self.cache = cache_stage_for(handler_settings, self.model_name, self.model_version,
                                     self.near_duplicate_image)
        self.shadow = shadow_stage_for(self.model_name, self.model_version, self.compare_answers,
                                       self.replayable)
        if continuous is not None:
            self.continuous = ContinuousServing(self.run_slots, self.describe, continuous,
                                                f"{self.model_name} {self.model_version}")
        self.initialized = True

    def torch_computes(self) -> bool:
        """Whether a network of this worker computes in torch (eager, or an AOTInductor
        package). A kind with more torch work than its networks' (a pipeline's crops) overrides it."""
        return not self.runners or any(choice.computes_in_torch for choice in self.runners.values())

    @property
    def runner(self) -> str:
        """"eager" when any network serves eagerly (or none is compiled), else the runners that
        serve, e.g. "openvino-bf16" (joined with "+" when a pipeline's networks differ)."""
        names = [choice.runner for choice in self.runners.values()]
        if not names or "eager" in names:
            return "eager"
        return "+".join(dict.fromkeys(names))

    def describe(self) -> dict[str, Any]:
        """This worker's answer to `GET /models/{m}/{v}?customized=true` (TorchServe shows it as
        `customizedMetadata`): device, precision, batch bound, the runner of each network, the
        TorchServe frontend it serves (rollout history entries name their server by it), and
        the model's Open Inference Protocol metadata (`v2`: its input and outputs)."""
        return {"device": str(self.device), "precision": self.precision,
                "max_batch_size": self.max_batch_size, "batching": self.batching,
                "runner": self.runner,
                "runners": {role: choice.describe() for role, choice in self.runners.items()},
                "frontend": frontend_identity(),
                "shadow": self.shadow.describe() if self.shadow is not None else None,
                "v2": {"inputs": [IMAGE_INPUT_METADATA],
                       "outputs": output_metadata(self.v2_output_specs())}}

    def handle(self, data: Sequence[Mapping[str, Any]], context: TorchServeContext) -> Any:
        """TorchServe's entry point: `handle_batch`'s answers, or, in TorchServe's asynchronous
        worker mode, an awaitable of them (the requests join the continuous batcher: see
        handlers.continuous_serving)."""
        if self.continuous is not None:
            return self.continuous.handle(data, context)
        return self.handle_batch(data, context)

    def handle_batch(self, data: Sequence[Mapping[str, Any]],
                     context: TorchServeContext) -> list[bytes]:
        """One JSON body per request, in order; statuses set per request on `context`. A request
        in the Open Inference Protocol's form is answered in that form. With a response cache,
        hits are answered without decoding or inference. TorchServe's describe job (see
        `is_describe_request`) gets `describe()`."""
        if is_describe_request(data, context):
            return [json.dumps(self.describe()).encode("utf-8")]
        return self.run_slots([RequestSlot(index, row, header_reader(context, index), context)
                               for index, row in enumerate(data)])

    def run_slots(self, slots: Sequence[RequestSlot]) -> list[bytes]:
        """One batch through every stage; one body per slot, in order."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)     # per thread: the batcher has its own
        waited_ms = (None if self.last_batch_answered is None
                     else (time.perf_counter() - self.last_batch_answered) * 1000)
        try:
            with host_batches().batch(solo_eligible(len(slots), self.max_batch_size)):
                return self.run_batch(slots, waited_ms)
        finally:
            self.last_batch_answered = time.perf_counter()

    def run_batch(self, slots: Sequence[RequestSlot], waited_ms: float | None = None) -> list[bytes]:
        """`run_slots` inside the host's batch registration (handlers.model.host_batches: an
        engine with `solo_threads` takes them for a batch that began alone on the host);
        `waited_ms`: how long the worker waited for this batch since its previous answers."""
        record = BatchRecord(self.model_name, self.model_version, size=len(slots), runner=self.runner,
                             waited_ms=waited_ms)
        protocol = ProtocolStage(self.model_name, self.model_version, self.v2_outputs)
        with record.timing("decode"):
            for slot in slots:
                protocol.read(slot)
                self.parse(slot)
        stages = self.stages
        run_stages(stages, record, "parsed", lambda stage: stage.parsed(slots, record))
        with record.timing("decode"):
            self.decode_open(slots)
        run_stages(stages, record, "decoded", lambda stage: stage.decoded(slots, record))
        computed = open_slots(slots)
        if computed:
            answers = iter(self.answer_in_chunks(
                [item for slot in computed for item in slot.decoded], record))
            for slot in computed:
                own = list(islice(answers, len(slot.decoded)))
                slot.answer_with(own if slot.several else own[0])
        metrics = slots[0].context.metrics
        run_stages(stages, record, "answered",
                   lambda stage: stage.answered(slots, computed, record, metrics))
        self.finish_record(record, slots)
        return [self.respond(slot, len(slots), protocol) for slot in slots]

    def parse(self, slot: RequestSlot) -> None:
        """An open slot's image bytes and options, once; a ClientError refuses it."""
        if slot.is_open:
            try:
                slot.parsed = self.parse_request(slot.row, slot.header)
            except ClientError as error:
                slot.refuse(error)

    def decode_open(self, slots: Sequence[RequestSlot]) -> None:
        """Every image of the open, parsed requests, decoded as one batch (`decode_images`); a
        bad image refuses its own request (naming the image when it sent several)."""
        pending = [(slot, slot.parsed) for slot in open_slots(slots) if slot.parsed is not None]
        results = iter(self.decode_images([image for _, parsed in pending for image in parsed.images]))
        for slot, parsed in pending:
            decoded = list(islice(results, len(parsed.images)))
            own = [result for result, _ in decoded]
            images = [result for result in own if not isinstance(result, ClientError)]
            if len(images) == len(own):
                slot.decoded = [DecodedImage(image, parsed.options) for image in images]
                slot.headers = [header for _, header in decoded]
                continue
            index, error = next((index, result) for index, result in enumerate(own)
                                if isinstance(result, ClientError))
            slot.refuse(error.of_image(index) if parsed.several else error)

    def answer_in_chunks(self, items: Sequence[DecodedImage[Options]],
                         record: BatchRecord) -> list[Any]:
        """`answer_items` over the images of the open requests, at most `max_batch_size` at a time
        (what the compiled package and warm-up cover): a request with several images adds them
        all to the batch."""
        answers: list[Any] = []
        with torch.inference_mode():
            for start in range(0, len(items), self.max_batch_size):
                answers += self.answer_items(items[start:start + self.max_batch_size], record)
        self.record_answers(record, answers)
        return answers

    @property
    def stages(self) -> list[BatchStage]:
        """The optional stages, in the order their hooks run (handlers.batch.batch_stage): the one
        list a new stage joins."""
        return [stage for stage in (self.cache, self.drift, self.payload_samples, self.shadow)
                if stage is not None]

    def finish_record(self, record: BatchRecord, slots: Sequence[RequestSlot]) -> None:
        record.answered = sum(slot.error is None for slot in slots)
        record.rejected.update(slot.error.error_type for slot in slots if slot.error is not None)
        if self.continuous is not None:
            record.gauges["QueuedRequests"] = self.continuous.batcher.queued
        record.finish()
        if self.log_batches:
            logger.info(record.to_log_line())
        emit_batch_metrics(slots[0].context.metrics, record)

    def answer_items(self, items: Sequence[DecodedImage[Options]], record: BatchRecord) -> list[Any]:
        """preprocess -> infer -> postprocess over `items`; on CUDA out-of-memory, the items are
        split in halves and each half retried, down to single items (a single item that still
        does not fit fails the batch, as a server fault)."""
        try:
            with record.timing("preprocess"):
                model_input = self.preprocess(items)
            with record.timing("inference"):
                model_output = self.infer(model_input)
                if self.device.type == "cuda":      # the batch's own work, not the device's
                    torch.cuda.current_stream(self.device).synchronize()
            with record.timing("postprocess"):
                answers = self.postprocess(model_output, model_input, items)
        except torch.cuda.OutOfMemoryError:
            if len(items) == 1:
                raise
        else:
            if len(answers) != len(items):
                raise ValueError(f"{len(answers)} answers for {len(items)} images")
            return answers
        # Retried outside the except block, so the failed attempt's tensors are already freed.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        half = len(items) // 2
        record.oom_splits += 1
        logger.warning("out of memory on %d items; retrying as %d + %d", len(items), half,
                       len(items) - half)
        return self.answer_items(items[:half], record) + self.answer_items(items[half:], record)

    def respond(self, slot: RequestSlot, batch_size: int, protocol: ProtocolStage) -> bytes:
        """Set a settled request's status, content type and headers on its context; its body."""
        index, context = slot.index, slot.context
        context.set_response_content_type(index, JSON_CONTENT_TYPE)
        context.set_response_header(index, BATCH_SIZE_HEADER, str(batch_size))
        context.set_response_header(index, MODEL_VERSION_HEADER, self.model_version)
        if slot.cache_status is not None:
            context.set_response_header(index, CACHE_HEADER, slot.cache_status)
        if slot.error is not None:
            context.set_response_status(slot.error.status, slot.error.phrase, index)
        elif not slot.several:
            for name, value in self.answer_headers(slot.answer).items():
                context.set_response_header(index, name, value)
        return protocol.body(slot)

    # --- hooks ----------------------------------------------------------------------------
    @abstractmethod
    def parse_settings(self, handler_section: Mapping[str, Any]) -> Settings:
        """The archive's `handler:` section -> this handler's settings (SettingsError if bad);
        `initialize` keeps them in `self.settings` before `load`."""

    @abstractmethod
    def load(self, serialized_file: str | None) -> None:
        """Load the model(s) of `self.settings` onto `self.device` (with
        `handlers.model.classifier_model` / `handlers.model.detector_model`); set `labels`, `precision`,
        `runners` for the networks that have compiled packages, and `jpeg_draft_size`."""

    @abstractmethod
    def parse_options(self, row: Mapping[str, Any], header: HeaderReader) -> Options:
        """One request's options (body fields or headers over the archive's defaults) as this
        kind's frozen dataclass; ClientError(400) when a value is invalid."""

    @abstractmethod
    def preprocess(self, items: Sequence[DecodedImage[Options]]) -> ModelInput:
        """The decoded items of the batch -> the model's batched input on `self.device`."""

    @abstractmethod
    def infer(self, model_input: ModelInput) -> ModelOutput:
        """One forward pass over the whole batch."""

    @abstractmethod
    def postprocess(self, model_output: ModelOutput, model_input: ModelInput,
                    items: Sequence[DecodedImage[Options]]) -> list[Any]:
        """The batch's output -> one JSON-serialisable answer per item, in order. `model_input` is
        what `preprocess` returned, with any geometry it recorded (e.g. letterbox parameters)."""

    @abstractmethod
    def warm_up(self, batch_size: int) -> None:
        """Run the model at the sizes requests will use, so no request pays first-call costs."""

    @abstractmethod
    def v2_outputs(self, answer: Any) -> list[TensorOutput]:
        """One request's answer (as `postprocess` gave it) as Open Inference Protocol tensors."""

    @abstractmethod
    def v2_output_specs(self) -> Sequence[OutputSpec]:
        """What `v2_outputs` gives, for the model's v2 metadata (see `describe`)."""

    @abstractmethod
    def compare_answers(self, production: Any, candidate: Any) -> AnswerComparison:
        """How far a candidate version's answer (parsed JSON) is from this version's answer to
        the same request (as `postprocess` gave it): see handlers.shadow.answer_comparison."""

    def parse_request(self, row: Mapping[str, Any], header: HeaderReader) -> ParsedRequest[Options]:
        """One request's encoded images and options (parsed once: they key the cache and drive
        decoding); ClientError when either is malformed, 413 for more images than
        `limits.max_images_per_request`."""
        images, several = extract_images(row, self.option_fields,
                                         self.settings.limits.max_images_per_request)
        return ParsedRequest(tuple(images), self.parse_options(row, header), several)

    def decode_images(self, encoded: Sequence[bytes]) -> list[tuple[DecodeResult, ImageHeader | None]]:
        """The batch's encoded images decoded together onto the device, each a tensor or its own
        ClientError, with the header it was decoded by (handlers.request.decode)."""
        return decode_with_headers(encoded, self.settings.limits, self.device, self.jpeg_draft_size,
                                   self.settings.jpeg_decoder, self.settings.cuda_preprocess_kernels)

    def decode(self, image_bytes: bytes, options: Options) -> DecodedImage[Options]:
        """One encoded image decoded as `decode_images` does (ClientError for a bad one)."""
        result = self.decode_images([image_bytes])[0][0]
        if isinstance(result, ClientError):
            raise result
        return DecodedImage(result, options)

    def replayable(self, slot: RequestSlot) -> bool:
        """The request's options all come from its headers (the same headers over an empty body
        give the same options), so its image bytes and headers replay it exactly."""
        assert slot.parsed is not None
        try:
            return self.parse_options({}, slot.header) == slot.parsed.options
        except ClientError:
            return False

    def record_answers(self, record: BatchRecord, answers: Sequence[Any]) -> None:
        """Add this handler's own counters / gauges for the batch's answers to `record`
        (exported as Handler<Name> metrics and in the batch log line; default: none)."""

    def near_duplicate_image(self, item: DecodedImage[Options]) -> torch.Tensor | None:
        """The decoded image whose perceptual hash keys near-duplicates (default: none; the
        classifiers give theirs: near-duplicate mode is for classification only)."""
        return None

    def answer_observations(self, answer: Any) -> list[Observation]:
        """The drift buckets of one image's answer (handlers.drift.drift_features; default: none,
        so only the inputs are watched)."""
        return []

    def answer_headers(self, answer: Any) -> Mapping[str, str]:
        """Response headers of one successful answer (default: none)."""
        return {}
