"""Per-model settings, parsed once from the `handler:` section of the archive's YAML.

Every value is validated up front; a bad value raises `SettingsError` naming the key and the
accepted values, so a broken archive fails at load time with a readable message instead of on
the first request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from handlers.ground import triton_kernels
from handlers.ground.fractions import fraction_of
from handlers.ground.kind_options import DetectionOptions
from handlers.ground.limits import ImageLimits, SettingsError
from handlers.model.compiled_model import CPU_TARGETS, CompiledPackage, CompileTarget
from handlers.model.runner_order import ENGINE_WEIGHTS, ENGINES, RunnerName, parse_runner_order
from handlers.model.runner_selection import ArchiveRunners, EngineModel
from handlers.request import nvimgcodec_decoder
from handlers.request.jpeg_batches import JpegDecoder
from handlers.task.transforms import ResizeLibrary

ModelSourceKind = Literal["timm", "torchvision", "project", "torchscript", "export", "ultralytics"]
# Sources named by an architecture and a state dict (`project`: an architecture defined in this
# project, handlers.model.project_architectures); the others are whole programs (`ultralytics`:
# an Ultralytics export, TorchScript or ONNX by its file: handlers.model.model_loading).
STATE_DICT_SOURCES = ("timm", "torchvision", "project")
# `yolo`: a YOLO-style single-tensor output, letterboxed and NMS'd the project's way;
# `ultralytics`: the same output served as Ultralytics' own predict serves it.
DetectionOutput = Literal["torchvision", "yolo", "ultralytics"]
# What a classifier's network returns: logits (softmaxed here) or probabilities already (an
# Ultralytics classification export, whose head ends in a softmax).
ClassifierOutput = Literal["logits", "probabilities"]
# An SSD-family detector's postprocess: `batched` (handlers.task.ssd_postprocess: the batch at once,
# a fixed number of synchronisations), `per-image` (torchvision's own loop), `auto` (batched on a
# GPU, torchvision's on a CPU, where its loop is the faster: docs/benchmarks.md).
DetectorPostprocess = Literal["auto", "batched", "per-image"]
Precision = Literal["fp32", "tf32", "fp16", "bf16"]
CpuTargetName = Literal["avx2", "avx512"]
DEFAULT_COMPILED_LOAD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ModelSource:
    """Where the network comes from: an architecture name plus a state dict, or a whole program."""

    source: ModelSourceKind
    architecture: str | None
    num_classes: int | None
    # Extra keyword arguments for the architecture's builder, e.g. a detector's score_thresh.
    builder_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CompileSettings:
    """`compile:` ahead of time: `torchserve-vision build` builds the model for each of `engines`
    into the archive (AOTInductor packages, an OpenVINO IR, an ONNX model) with the preference
    order per CPU kind (`runner_order`; None: runner_order.DEFAULT_RUNNER_ORDER); a worker loads
    the first that passes its check (never compiles) or serves eagerly. See
    handlers.model.runner_selection."""

    cpu_target: CpuTargetName = "avx2"              # a key of compiled_model.CPU_TARGETS
    load_timeout_s: float = DEFAULT_COMPILED_LOAD_TIMEOUT_S
    engines: tuple[str, ...] = ENGINES
    runner_order: Mapping[str, tuple[RunnerName, ...]] | None = None
    int8: Int8Settings | None = None       # an int8 OpenVINO model too (None: not built)


@dataclass(frozen=True)
class Int8Settings:
    """`compile.int8`: the builder quantizes the OpenVINO model to int8 (post-training, calibrated
    on `calibration_images` variants of real photos) and keeps it only when its top-1 agrees with
    the fp32 model's on at least `min_agreement` of `gate_images` variants of other photos
    (torchserve_vision/archives/int8_quantization.py)."""

    min_agreement: float = 0.96
    calibration_images: int = 300
    gate_images: int = 300


@dataclass(frozen=True)
class HandlerSettings:
    """What every handler's settings have: the network, its class names, the precision asked
    for (what runs depends on the device: model_loading.resolve_precision), request limits."""

    model: ModelSource
    labels_file: str
    precision: Precision
    limits: ImageLimits
    # A CUDA worker's batched JPEG decoder (parse_jpeg_decoder).
    jpeg_decoder: JpegDecoder = field(default="torchvision", kw_only=True)
    # A CUDA worker's exact preprocessing as Triton kernels (parse_cuda_preprocess_kernels).
    cuda_preprocess_kernels: bool = field(default=False, kw_only=True)


@dataclass(frozen=True)
class ClassifierSettings(HandlerSettings):
    resize_size: int
    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    top_k: int
    channels_last: bool
    compile: CompileSettings | None
    jpeg_draft: bool = True
    output: ClassifierOutput = "logits"
    resize: ResizeLibrary = "torchvision"
    # Threads an OpenVINO / ONNX Runtime runner takes for a batch that begins while no other
    # worker of the host is in one (handlers.model.host_batches); None: the worker's threads.
    solo_threads: int | None = None
    compiled_packages: tuple[CompiledPackage, ...] = ()
    engine_models: tuple[EngineModel, ...] = ()      # written by the archive builder
    runner_order: Mapping[str, tuple[RunnerName, ...]] | None = None   # likewise
    # A CUDA worker replays one CUDA graph per batch bucket, and runs fp16 / bf16 as weights of
    # that dtype rather than autocast over float32 ones (handlers.model.cuda_batches).
    cuda_graphs: bool = False
    cuda_half_weights: bool = True
    cuda_fold_batch_norm: bool = True

    @property
    def archive_runners(self) -> ArchiveRunners:
        return ArchiveRunners(self.compiled_packages, self.engine_models, self.runner_order)


def _require(section: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in section:
        raise SettingsError(f"missing required setting '{where}.{key}'")
    return section[key]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SettingsError(f"'{name}' must be a positive integer, got {value!r}")
    return value


def _triple(value: Any, name: str, positive: bool) -> tuple[float, float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise SettingsError(f"'{name}' must be a list of 3 numbers (R, G, B), got {value!r}")
    numbers = tuple(float(v) for v in value)
    if positive and min(numbers) <= 0:
        raise SettingsError(f"'{name}' values must be > 0, got {value!r}")
    return (numbers[0], numbers[1], numbers[2])


def _choice(value: Any, name: str, kind: object) -> Any:
    """`value` if it is one of the strings of the Literal type `kind`, else SettingsError (the
    result is typed by the field it fills)."""
    choices = get_args(kind)
    if value not in choices:
        raise SettingsError(f"'{name}' must be one of {', '.join(choices)}; got {value!r}")
    return value


def parse_model_source(section: Mapping[str, Any]) -> ModelSource:
    source = _choice(_require(section, "source", "model"), "model.source", ModelSourceKind)
    architecture = section.get("architecture")
    if source in STATE_DICT_SOURCES and not architecture:
        raise SettingsError(f"'model.architecture' is required for source '{source}'")
    num_classes = section.get("num_classes")
    if num_classes is not None:
        num_classes = _positive_int(num_classes, "model.num_classes")
    builder_kwargs = section.get("kwargs") or {}
    if not isinstance(builder_kwargs, Mapping):
        raise SettingsError(f"'model.kwargs' must be a mapping, got {builder_kwargs!r}")
    return ModelSource(source, architecture, num_classes, dict(builder_kwargs))


def parse_limits(section: Mapping[str, Any]) -> ImageLimits:
    defaults = ImageLimits()
    return ImageLimits(
        max_body_bytes=_positive_int(
            section.get("max_body_bytes", defaults.max_body_bytes), "limits.max_body_bytes"
        ),
        max_pixels=_positive_int(section.get("max_pixels", defaults.max_pixels), "limits.max_pixels"),
        min_side_px=_positive_int(
            section.get("min_side_px", defaults.min_side_px), "limits.min_side_px"
        ),
        max_frames=_positive_int(section.get("max_frames", defaults.max_frames), "limits.max_frames"),
        max_images_per_request=_positive_int(
            section.get("max_images_per_request", defaults.max_images_per_request),
            "limits.max_images_per_request",
        ),
        max_decode_pixels_per_call=_positive_int(
            section.get("max_decode_pixels_per_call", defaults.max_decode_pixels_per_call),
            "limits.max_decode_pixels_per_call",
        ),
    )


def _switch(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise SettingsError(f"'{name}' must be true or false, got {value!r}")
    return value


def parse_log_batches(handler_section: Mapping[str, Any]) -> bool:
    """`log_batches` (default true): one `batch {json}` log line per batch."""
    return _switch(handler_section.get("log_batches", True), "log_batches")


def parse_torch_threads(handler_section: Mapping[str, Any]) -> int | None:
    """`torch_threads`: intra-op threads of each worker (default: PyTorch's, one per core).
    With several workers on a CPU host, workers x threads should not exceed the cores."""
    value = handler_section.get("torch_threads")
    return None if value is None else _positive_int(value, "torch_threads")


def parse_solo_threads(handler_section: Mapping[str, Any]) -> int | None:
    """`solo_threads`: threads of an engine runner's batch that begins while the host's other
    workers are idle (at least `torch_threads`; default: none beyond the worker's own)."""
    value = handler_section.get("solo_threads")
    if value is None:
        return None
    solo = _positive_int(value, "solo_threads")
    threads = parse_torch_threads(handler_section)
    if threads is not None and solo < threads:
        raise SettingsError(f"'solo_threads' ({solo}) must be at least 'torch_threads' ({threads})")
    return solo


DEFAULT_MAX_QUEUED = 100   # TorchServe's default job_queue_size


@dataclass(frozen=True)
class ContinuousBatching:
    """`continuous_batching:` of the handler section (the archive's YAML then also says
    `asyncCommunication: true`): the worker batches whatever has arrived, up to
    `max_batch_size`, with at most `max_queued` requests waiting (one more is answered 503 at
    once: in this mode the frontend hands every request to the worker as it arrives, so its
    job_queue_size bounds nothing). The model is registered with batch size 1 and no delay."""

    max_queued: int = DEFAULT_MAX_QUEUED
    max_batch_size: int = 8


def parse_continuous_batching(handler_section: Mapping[str, Any]) -> ContinuousBatching | None:
    section = handler_section.get("continuous_batching")
    if section is None or section is False:
        return None
    if section is True:
        return ContinuousBatching()
    if not isinstance(section, Mapping) or set(section) - {"max_queued", "max_batch_size"}:
        raise SettingsError("'continuous_batching' must be true or a mapping with 'max_queued' and "
                            f"'max_batch_size'; got {section!r}")
    return ContinuousBatching(
        _positive_int(section.get("max_queued", DEFAULT_MAX_QUEUED), "continuous_batching.max_queued"),
        _positive_int(section.get("max_batch_size", 8), "continuous_batching.max_batch_size"))


def parse_compile(value: Any) -> CompileSettings | None:
    """`compile`: false / absent (eager), true (the defaults), or a mapping of CompileSettings."""
    if value in (None, False):
        return None
    if value is True:
        return CompileSettings()
    if not isinstance(value, Mapping):
        raise SettingsError(f"'compile' must be true, false or a mapping with 'cpu_target' "
                            f"({', '.join(CPU_TARGETS)}), 'load_timeout_s', 'engines' and "
                            f"'runner_order'; got {value!r} (a worker never runs torch.compile: "
                            "models are built ahead of time)")
    unknown = set(value) - {"cpu_target", "load_timeout_s", "engines", "runner_order", "int8"}
    if unknown:
        raise SettingsError(f"unknown 'compile' settings: {sorted(unknown)}")
    timeout = value.get("load_timeout_s", DEFAULT_COMPILED_LOAD_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise SettingsError(f"'compile.load_timeout_s' must be a positive number, got {timeout!r}")
    engines = parse_engines(value.get("engines", list(ENGINES)))
    int8 = parse_int8(value.get("int8"))
    if int8 is not None and "openvino" not in engines:
        raise SettingsError("'compile.int8' quantizes the OpenVINO model: add 'openvino' to "
                            f"'compile.engines' ({list(engines)})")
    return CompileSettings(
        cpu_target=_choice(value.get("cpu_target", "avx2"), "compile.cpu_target", CpuTargetName),
        load_timeout_s=float(timeout),
        engines=engines,
        runner_order=parse_order(value.get("runner_order"), "compile.runner_order"),
        int8=int8,
    )


def parse_int8(value: Any) -> Int8Settings | None:
    """`compile.int8`: false / absent (none), true (the defaults), or a mapping of Int8Settings."""
    if value in (None, False):
        return None
    if value is True:
        return Int8Settings()
    if not isinstance(value, Mapping) or set(value) - {"min_agreement", "calibration_images", "gate_images"}:
        raise SettingsError(f"'compile.int8' must be true, false or a mapping with 'min_agreement' "
                            f"(0..1), 'calibration_images' and 'gate_images'; got {value!r}")
    agreement = value.get("min_agreement", Int8Settings.min_agreement)
    if isinstance(agreement, bool) or not isinstance(agreement, (int, float)) or not 0 <= agreement <= 1:
        raise SettingsError(f"'compile.int8.min_agreement' must be a share from 0 to 1, got {agreement!r}")
    return Int8Settings(
        float(agreement),
        _positive_int(value.get("calibration_images", Int8Settings.calibration_images),
                      "compile.int8.calibration_images"),
        _positive_int(value.get("gate_images", Int8Settings.gate_images), "compile.int8.gate_images"))


def parse_engines(value: Any) -> tuple[str, ...]:
    """`compile.engines`: a non-empty list of engines to build, each once."""
    if isinstance(value, str) or not isinstance(value, list) or not value:
        raise SettingsError(f"'compile.engines' must be a non-empty list of {list(ENGINES)}, got {value!r}")
    for engine in value:
        if engine not in ENGINES:
            raise SettingsError(f"'compile.engines' has unknown engine {engine!r}; "
                                f"engines are {list(ENGINES)}")
    if len(set(value)) != len(value):
        raise SettingsError(f"'compile.engines' names an engine twice: {value}")
    return tuple(value)


def parse_order(value: Any, where: str) -> Mapping[str, tuple[RunnerName, ...]] | None:
    """A runner order table ({cpu kind: [runner, ...]}), or None when absent."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SettingsError(f"'{where}' must map CPU kinds to lists of runners, got {value!r}")
    try:
        return parse_runner_order(value)
    except ValueError as error:
        raise SettingsError(f"'{where}': {error}") from None


def parse_engine_models(value: Any) -> tuple[EngineModel, ...]:
    """`engine_models` (written by the archive builder): [{engine, file, weights}, ...]
    (`weights` fp32 when absent)."""
    if value is None:
        return ()
    try:
        models = tuple(EngineModel(str(entry["engine"]), str(entry["file"]),
                                   str(entry.get("weights", "fp32"))) for entry in value)
    except (KeyError, TypeError, AttributeError) as error:
        raise SettingsError(f"'engine_models' is malformed: {error!r}") from None
    for model in models:
        if model.engine not in ENGINES or model.engine == "aoti":
            raise SettingsError(f"'engine_models' has unknown engine {model.engine!r}")
        if model.weights not in ENGINE_WEIGHTS:
            raise SettingsError(f"'engine_models' has unknown weights {model.weights!r} "
                                f"({list(ENGINE_WEIGHTS)})")
    return models


def parse_compiled_packages(value: Any) -> tuple[CompiledPackage, ...]:
    """`compiled_packages` (written by the archive builder): [{file, target: {...}}, ...]."""
    if value is None:
        return ()
    try:
        return tuple(CompiledPackage(str(entry["file"]), CompileTarget.from_dict(entry["target"]))
                     for entry in value)
    except (KeyError, TypeError, ValueError) as error:
        raise SettingsError(f"'compiled_packages' is malformed: {error!r}") from None


def parse_classifier_settings(handler_section: Mapping[str, Any] | None) -> ClassifierSettings:
    """Parse and validate the `handler:` section of a classification archive's YAML."""
    if not handler_section:
        raise SettingsError("the archive's YAML has no 'handler:' section")
    preprocess = handler_section.get("preprocess", {})
    input_size = _positive_int(preprocess.get("input_size", 224), "preprocess.input_size")
    resize_size = _positive_int(preprocess.get("resize_size", 256), "preprocess.resize_size")
    if resize_size < input_size:
        raise SettingsError(
            f"'preprocess.resize_size' ({resize_size}) must be >= 'preprocess.input_size' ({input_size})"
        )
    return ClassifierSettings(
        model=parse_model_source(_require(handler_section, "model", "handler")),
        labels_file=str(handler_section.get("labels_file", "labels.json")),
        resize_size=resize_size,
        input_size=input_size,
        resize=_choice(preprocess.get("resize", "torchvision"), "preprocess.resize", ResizeLibrary),
        mean=_triple(preprocess.get("mean", [0.485, 0.456, 0.406]), "preprocess.mean", False),
        std=_triple(preprocess.get("std", [0.229, 0.224, 0.225]), "preprocess.std", True),
        top_k=_positive_int(handler_section.get("top_k", 5), "top_k"),
        output=_choice(handler_section.get("output", "logits"), "output", ClassifierOutput),
        precision=_choice(handler_section.get("precision", "fp32"), "precision", Precision),
        channels_last=bool(handler_section.get("channels_last", False)),
        compile=parse_compile(handler_section.get("compile")),
        limits=parse_limits(handler_section.get("limits", {})),
        jpeg_draft=bool(handler_section.get("jpeg_draft", True)),
        solo_threads=parse_solo_threads(handler_section),
        compiled_packages=parse_compiled_packages(handler_section.get("compiled_packages")),
        engine_models=parse_engine_models(handler_section.get("engine_models")),
        runner_order=parse_order(handler_section.get("runner_order"), "runner_order"),
        cuda_graphs=_switch(handler_section.get("cuda_graphs", False), "cuda_graphs"),
        cuda_half_weights=_switch(handler_section.get("cuda_half_weights", True), "cuda_half_weights"),
        cuda_fold_batch_norm=_switch(handler_section.get("cuda_fold_batch_norm", True),
                                     "cuda_fold_batch_norm"),
        jpeg_decoder=parse_jpeg_decoder(handler_section),
        cuda_preprocess_kernels=parse_cuda_preprocess_kernels(handler_section),
    )


@dataclass(frozen=True)
class DetectorSettings(HandlerSettings):
    """A detector's settings. `runs_nms`: whether the handler runs the model's NMS (a YOLO-style
    model's, not an end-to-end export's nor a torchvision detector's own)."""

    output_format: DetectionOutput
    input_hw: tuple[int, int]          # a YOLO-style model's input (the generic path's: square)
    letterbox_fill: int
    defaults: DetectionOptions
    max_detections_cap: int
    postprocess: DetectorPostprocess = "auto"
    # An Ultralytics export that answers its detections (`[B, N, 6]`, no NMS to run here).
    end_to_end: bool = False
    # An engine's threads for a batch that begins while the host's other workers are idle (as a
    # classifier's: handlers.model.host_batches); None: the worker's own.
    solo_threads: int | None = None
    # `compile:` of an SSD-family detector: its backbone and head on OpenVINO / ONNX Runtime, fp32
    # weights (OpenVINO computes bf16 for `precision: bf16` where the CPU has it natively;
    # handlers.model.ssd_engine); what the builder wrote, as for a classifier.
    compile: CompileSettings | None = None
    engine_models: tuple[EngineModel, ...] = ()
    runner_order: Mapping[str, tuple[RunnerName, ...]] | None = None

    @property
    def archive_runners(self) -> ArchiveRunners:
        return ArchiveRunners((), self.engine_models, self.runner_order)

    @property
    def runs_nms(self) -> bool:
        return self.output_format != "torchvision" and not self.end_to_end


def _fraction_setting(value: Any, name: str) -> float:
    number = fraction_of(value) if isinstance(value, (int, float)) else None
    if number is None:
        raise SettingsError(f"'{name}' must be a number in [0, 1], got {value!r}")
    return number


def parse_detection_defaults(section: Mapping[str, Any]) -> tuple[DetectionOptions, int]:
    """The default per-request options and the largest max_detections a request may ask for."""
    cap = _positive_int(section.get("max_detections_cap", 1000), "detection.max_detections_cap")
    max_detections = _positive_int(section.get("max_detections", 100), "detection.max_detections")
    if max_detections > cap:
        raise SettingsError(f"'detection.max_detections' ({max_detections}) exceeds "
                            f"'detection.max_detections_cap' ({cap})")
    classes = section.get("classes")
    if classes is not None and (not isinstance(classes, list)
                                or not all(isinstance(c, int) and c >= 0 for c in classes)):
        raise SettingsError(f"'detection.classes' must be a list of class indices, got {classes!r}")
    options = DetectionOptions(
        score_threshold=_fraction_setting(section.get("score_threshold", 0.25),
                                          "detection.score_threshold"),
        iou_threshold=_fraction_setting(section.get("iou_threshold", 0.45), "detection.iou_threshold"),
        max_detections=max_detections,
        classes=frozenset(classes) if classes is not None else None,
    )
    return options, cap


def parse_input_hw(value: Any, name: str) -> tuple[int, int]:
    """A side (square) or [height, width], each a positive integer."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return _positive_int(value[0], name), _positive_int(value[1], name)
    side = _positive_int(value, name)
    return side, side


def parse_detector_settings(handler_section: Mapping[str, Any] | None) -> DetectorSettings:
    """Parse and validate the `handler:` section of a detection archive's YAML."""
    if not handler_section:
        raise SettingsError("the archive's YAML has no 'handler:' section")
    detection = handler_section.get("detection", {})
    defaults, cap = parse_detection_defaults(detection)
    fill = detection.get("letterbox_fill", 114)
    if isinstance(fill, bool) or not isinstance(fill, int) or not 0 <= fill <= 255:
        raise SettingsError(f"'detection.letterbox_fill' must be an integer 0..255, got {fill!r}")
    input_hw = parse_input_hw(detection.get("input_size", 640), "detection.input_size")
    end_to_end = _switch(detection.get("end_to_end", False), "detection.end_to_end")
    if end_to_end and detection.get("output") != "ultralytics":
        raise SettingsError("'detection.end_to_end' applies to Ultralytics exports (detection.output: "
                            "ultralytics)")
    if detection.get("output") == "yolo" and input_hw[0] != input_hw[1]:
        raise SettingsError(f"'detection.output: yolo' letterboxes to a square input; got "
                            f"'detection.input_size' {list(input_hw)} (an Ultralytics export of any "
                            "size: output ultralytics)")
    return DetectorSettings(
        model=parse_model_source(_require(handler_section, "model", "handler")),
        labels_file=str(handler_section.get("labels_file", "labels.json")),
        output_format=_choice(detection.get("output", "torchvision"), "detection.output",
                              DetectionOutput),
        input_hw=input_hw,
        letterbox_fill=fill,
        defaults=defaults,
        max_detections_cap=cap,
        postprocess=_choice(detection.get("postprocess", "auto"), "detection.postprocess",
                            DetectorPostprocess),
        end_to_end=end_to_end,
        solo_threads=parse_solo_threads(handler_section),
        precision=_choice(handler_section.get("precision", "fp32"), "precision", Precision),
        limits=parse_limits(handler_section.get("limits", {})),
        compile=parse_detector_compile(handler_section.get("compile"), detection.get("output")),
        engine_models=parse_engine_models(handler_section.get("engine_models")),
        runner_order=parse_order(handler_section.get("runner_order"), "runner_order"),
        jpeg_decoder=parse_jpeg_decoder(handler_section),
        cuda_preprocess_kernels=parse_cuda_preprocess_kernels(handler_section),
    )


def parse_jpeg_decoder(handler_section: Mapping[str, Any]) -> JpegDecoder:
    """`jpeg_decoder:` the batched JPEG decoder of a CUDA worker: `torchvision` (nvJPEG through
    torchvision.io) or `nvimgcodec` (nvImageCodec, the GPU's JPEG engines where it has them), which
    must then be installed where the workers run."""
    decoder: JpegDecoder = _choice(handler_section.get("jpeg_decoder", "torchvision"), "jpeg_decoder",
                                   JpegDecoder)
    if decoder == "nvimgcodec" and not nvimgcodec_decoder.available():
        raise SettingsError("'jpeg_decoder: nvimgcodec' needs nvImageCodec where the workers run "
                            "(pip install nvidia-nvimgcodec-cu13)")
    return decoder


def parse_cuda_preprocess_kernels(handler_section: Mapping[str, Any]) -> bool:
    """`cuda_preprocess_kernels:` on a CUDA worker, the chroma interpolation after nvJPEG (every
    kind) and the classifier's resize, crop and normalisation as Triton kernels
    (handlers.request.chroma_kernels, handlers.task.resize_kernels) instead of tensor
    operations: the same values, fewer kernels, no float32 copy of the images. Triton must
    import where the workers run (it comes with torch's Linux wheels)."""
    enabled = _switch(handler_section.get("cuda_preprocess_kernels", False), "cuda_preprocess_kernels")
    if enabled and not triton_kernels.available():
        raise SettingsError("'cuda_preprocess_kernels: true' needs Triton where the workers run "
                            "(it comes with torch's Linux wheels)")
    return enabled


DETECTOR_ENGINES = ("openvino", "onnxruntime")
# An Ultralytics TorchScript export's engine beside the export itself (handlers.model.ultralytics_engine).
ULTRALYTICS_ENGINES = ("openvino",)


def parse_detector_compile(value: Any, output: Any) -> CompileSettings | None:
    """A detector's `compile:`: as a classifier's, less what a detector cannot have (an
    AOTInductor package: torchvision detectors take lists of differently sized images; int8:
    its gate is a classifier's top-1 agreement); torchvision-format detectors, and Ultralytics
    exports (OpenVINO only: ULTRALYTICS_ENGINES)."""
    settings = parse_compile(value)
    if settings is None:
        return None
    if output == "ultralytics":
        if value is True or "engines" not in value:
            settings = replace(settings, engines=ULTRALYTICS_ENGINES)
        if set(settings.engines) - set(ULTRALYTICS_ENGINES) or settings.int8 is not None:
            raise SettingsError(f"an Ultralytics export's 'compile' builds its OpenVINO model in fp32: "
                                f"'compile.engines' {list(settings.engines)} cannot apply")
        return settings
    if output not in (None, "torchvision"):
        raise SettingsError("'compile' applies to torchvision detectors and Ultralytics exports "
                            "(detection.output: torchvision or ultralytics)")
    if value is True or "engines" not in value:
        settings = replace(settings, engines=DETECTOR_ENGINES)
    if set(settings.engines) - set(DETECTOR_ENGINES) or settings.int8 is not None:
        raise SettingsError(f"a detector's 'compile' builds its backbone and head for "
                            f"{list(DETECTOR_ENGINES)} in fp32: 'compile.engines' {list(settings.engines)}"
                            f"{' and compile.int8' if settings.int8 is not None else ''} cannot apply")
    return settings
