"""Build TorchServe model archives (.mar) from model descriptions.

Each archive `<name>-<version>.mar` lands in the model store with the `handlers/` package, the
class names and the handler's settings inside it, so it is self-contained. Weights are checked
against the architecture before archiving; a classifier with `compile:` gets ahead-of-time
compiled models (AOTInductor packages: compile_ahead.py; OpenVINO and ONNX: engine_exports.py;
a gated int8 OpenVINO model: int8_quantization.py) and the order its workers try them in; an
SSD-family detector with `compile:` gets its backbone and head for OpenVINO and ONNX Runtime.
Any problem stops the build with a BuildError.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

import handlers
from handlers.ground.limits import SettingsError
from handlers.model.compiled_model import COMPILED_DIRECTORY, CompiledPackage
from handlers.model.model_loading import create_architecture, load_model, load_state_dict_model
from handlers.model.project_architectures import PROJECT_ARCHITECTURES
from handlers.model.runner_order import (
    DEFAULT_DETECTOR_RUNNER_ORDER,
    DEFAULT_RUNNER_ORDER,
    DEFAULT_ULTRALYTICS_RUNNER_ORDER,
    RunnerName,
    parse_runner_order,
)
from handlers.model.runner_selection import EngineModel
from handlers.model.settings import (
    STATE_DICT_SOURCES,
    ModelSource,
    parse_classifier_settings,
    parse_compile,
    parse_detector_compile,
    parse_input_hw,
    parse_model_source,
)
from handlers.model.ssd_engine import NotAnSsdDetector, ssd_input_size_hw
from torchserve_vision.archives import ARCHIVER, BuildTarget
from torchserve_vision.archives.compile_ahead import (
    CompileRequest,
    compile_packages,
    without_inplace_activations,
)
from torchserve_vision.archives.drift_reference import (
    FEATURES_OF_TASK,
    REFERENCE_REQUESTS,
    add_profile,
    profile_source,
    record_profile,
    reference_bodies,
)
from torchserve_vision.archives.engine_exports import (
    export_detector_engines,
    export_engine_models,
    export_ultralytics_engines,
)
from torchserve_vision.archives.fixed_seed_weights import fixed_seed_model
from torchserve_vision.archives.int8_quantization import Int8Gate, Int8GateFailed, Int8Request, Preprocessing
from torchserve_vision.archives.pipelines import PipelineError, pipeline_handler_section
from torchserve_vision.archives.pretrained_weights import packaged_state_dict
from torchserve_vision.archives.ultralytics_exports import (
    ExportError,
    UltralyticsExport,
    read_export,
)
from torchserve_vision.archives.ultralytics_exports import handler_options as export_handler_options
from torchserve_vision.archives.weights_error import WeightsError
from torchserve_vision.errors import CommandError
from torchserve_vision.model_descriptions import (
    EXPORT_LABELS,
    QUEUED,
    SERIALIZED_NAMES,
    ULTRALYTICS_ONNX_NAME,
    DescriptionError,
    ModelDescription,
    resolve_labels,
)
from torchserve_vision.photo_sets import PhotoSetError

logger = logging.getLogger(__name__)
HANDLER_PACKAGE = Path(handlers.__file__).resolve().parent
# Archives store their files uncompressed (a zip all the same; TorchServe serves it as any
# .mar). Weights and compiled models make up almost all of an archive and deflate by only
# 7-30 %, and TorchServe's frontend inflates the whole archive at every registration: Lite0's
# (89 MB) costs the frontend 0.4 s of a core to register stored, 1.3 s deflated (78 MB), and
# torch-model-archiver 0.3 s to write instead of 3.1 (docs/benchmarks.md, "Building the archives").
ARCHIVE_FORMAT = "zip-store"


class BuildError(CommandError, RuntimeError):
    """A description or its files cannot make a working archive."""


# --- weights ------------------------------------------------------------------------------------
def unwrap_checkpoint(checkpoint: Any) -> dict[str, torch.Tensor]:
    """A state dict, or one nested under 'state_dict' / 'model' as training scripts save it."""
    for key in ("state_dict", "model"):
        if isinstance(checkpoint, dict) and isinstance(checkpoint.get(key), dict):
            checkpoint = checkpoint[key]
    if not isinstance(checkpoint, dict) or not all(torch.is_tensor(v) for v in checkpoint.values()):
        raise BuildError("the weights file does not hold a state dict of tensors")
    return checkpoint


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """A state dict file's tensors, those stored in half precision widened to float32 (the
    archives' networks are float32)."""
    if not path.is_file():
        raise BuildError(f"weights file not found: {path}")
    try:
        state = unwrap_checkpoint(torch.load(path, map_location="cpu", weights_only=True))
    except (RuntimeError, OSError, ValueError) as error:
        raise BuildError(f"cannot read weights file {path}: {error}") from None
    return {key: tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
            for key, tensor in state.items()}


def model_source(description: ModelDescription, num_classes: int | None) -> ModelSource:
    """The description's network, checked by the handler's own parser."""
    try:
        return parse_model_source({"source": description.source,
                                   "architecture": description.architecture,
                                   "num_classes": num_classes,
                                   "kwargs": dict(description.builder_kwargs)})
    except SettingsError as error:
        raise BuildError(f"{description.name}: {error}") from None


def fixed_seed_state_dict(description: ModelDescription, num_classes: int) -> dict[str, torch.Tensor]:
    """`fixed-seed:N`: the architecture under seed N, calibrated so answers differ per image."""
    try:
        seed = int(description.weights.split(":", 1)[1])
    except ValueError:
        raise BuildError(f"{description.name}: 'fixed-seed:N' needs an integer seed, "
                         f"got {description.weights!r}") from None
    source = model_source(description, num_classes)
    model = fixed_seed_model(lambda: create_architecture(source), seed,
                             detector=description.kind.network == "detector")
    return model.state_dict()


def write_state_dict(description: ModelDescription, num_classes: int, target: Path) -> None:
    """Resolve, check against the architecture (strict: every key, every shape), and save.

    `weights` is a state-dict file, `package:NAME` (real weights shipped in a package) or
    `fixed-seed:N` (the architecture's own initialisation under seed N, calibrated)."""
    if description.weights.startswith("fixed-seed:"):
        state_dict: Mapping[str, torch.Tensor] = fixed_seed_state_dict(description, num_classes)
    elif description.weights.startswith("package:"):
        try:
            state_dict = packaged_state_dict(description.weights[8:])
        except WeightsError as error:
            raise BuildError(str(error)) from None
    else:
        state_dict = load_weights_file(Path(description.weights).expanduser())
    torch.save(dict(state_dict), target)
    try:
        load_state_dict_model(model_source(description, num_classes), target)
    except (RuntimeError, ValueError) as error:
        raise BuildError(f"{description.name}: the weights do not fit "
                         f"{description.source}:{description.architecture}: {error}") from None


def copy_program(description: ModelDescription, target: Path) -> None:
    """Copy a TorchScript / torch.export file after checking it loads."""
    path = Path(description.weights).expanduser()
    if not path.is_file():
        raise BuildError(f"model file not found: {path}")
    try:
        if description.source == "torchscript":
            torch.jit.load(str(path), map_location="cpu")
        else:
            torch.export.load(str(path))
    except Exception as error:  # noqa: BLE001 - any failure means the file is unusable
        raise BuildError(f"{path} is not a loadable {description.source} file: {error}") from None
    shutil.copyfile(path, target)


# --- Ultralytics exports ---------------------------------------------------------------------------
# Handler options an export fixes: a description may not say otherwise (it would not answer as
# Ultralytics does); the others (thresholds, caps, limits, top_k) it may set.
EXPORT_FIXED = {("detection", "output"), ("detection", "input_size"), ("detection", "end_to_end"),
                ("preprocess", "input_size"), ("preprocess", "resize_size"), ("preprocess", "resize"),
                ("preprocess", "mean"), ("preprocess", "std"), ("output",)}


def with_export(description: ModelDescription) -> tuple[ModelDescription, UltralyticsExport | None]:
    """For `source: ultralytics`: its export, read and checked, and the description with the
    handler options the export implies under its own (a task or option that contradicts the
    export is a BuildError); other descriptions as they are, with None."""
    if description.source != "ultralytics":
        return description, None
    try:
        export = read_export(Path(description.weights).expanduser())
        implied = export_handler_options(export)
    except ExportError as error:
        raise BuildError(f"{description.name}: {error}") from None
    if description.task != export.task:
        raise BuildError(f"{description.name}: the description says task {description.task!r}, but "
                         f"{export.path.name} is an Ultralytics {export.task} export")
    options = {key: (dict(value) if isinstance(value, Mapping) else value) for key, value in implied.items()}
    for key, value in description.handler_options.items():
        if isinstance(value, Mapping) and isinstance(options.get(key), dict):
            for inner, inner_value in value.items():
                _check_not_fixed(description, (key, inner), options[key].get(inner), inner_value)
                options[key][inner] = inner_value
        else:
            _check_not_fixed(description, (key,), options.get(key), value)
            options[key] = value
    return replace(description, handler_options=options), export


def _comparable(key: tuple[str, ...], value: Any) -> Any:
    """A fixed option's value in one form: sizes as [height, width], numbers as floats."""
    if key == ("detection", "input_size") and isinstance(value, int):
        value = [value, value]
    if isinstance(value, (list, tuple)):
        return [float(item) if isinstance(item, (int, float)) else item for item in value]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _check_not_fixed(description: ModelDescription, key: tuple[str, ...], implied: Any, given: Any) -> None:
    if key in EXPORT_FIXED and _comparable(key, given) != _comparable(key, implied):
        raise BuildError(f"{description.name}: '{'.'.join(key)}: {given}' contradicts the export "
                         f"({implied}): an Ultralytics export is served as Ultralytics' predict serves "
                         "it (for another preprocessing, build it with --source torchscript)")


def export_labels(description: ModelDescription, export: UltralyticsExport) -> list[str]:
    """The export's own class names, or (`--labels`, `labels:`) the description's, as many."""
    if description.labels == EXPORT_LABELS:
        return list(export.names)
    try:
        labels = resolve_labels(description.labels)
    except DescriptionError as error:
        raise BuildError(f"{description.name}: {error}") from None
    if len(labels) != len(export.names):
        raise BuildError(f"{description.name}: {len(labels)} labels for the export's {len(export.names)} "
                         "classes")
    return labels


def check_architecture(description: ModelDescription) -> None:
    if description.source == "timm":
        import timm

        known = timm.is_model(description.architecture or "")
    elif description.source == "torchvision":
        import torchvision

        known = description.architecture in torchvision.models.list_models()
    elif description.source == "project":
        known = description.architecture in PROJECT_ARCHITECTURES
    else:
        return
    if not known:
        raise BuildError(f"{description.name}: unknown {description.source} architecture "
                         f"{description.architecture!r}")


# --- ahead-of-time compilation ---------------------------------------------------------------------
def compile_request(description: ModelDescription, int8_images: Path | None = None,
                    force_int8: bool = False) -> CompileRequest | None:
    """What `compile:` asks the builder to build (None: an eager archive); `int8_images` and
    `force_int8`: the build command's photos for `compile.int8` and its say over the gate."""
    if description.kind.network == "detector":
        return detector_compile_request(description)
    try:
        settings = parse_compile(description.handler_options.get("compile"))
    except SettingsError as error:
        raise BuildError(f"{description.name}: {error}") from None
    if settings is None:
        return None
    if not description.kind.compiles:
        raise BuildError(f"{description.name}: 'compile' applies to classification archives only")
    if description.source in ("torchscript", "ultralytics"):
        raise BuildError(f"{description.name}: a TorchScript or Ultralytics export cannot be compiled "
                         "ahead of time here; serve it as it is, or export it with torch.export "
                         "(source: export)")
    parsed = parse_classifier_settings({**description.handler_options,
                                        "model": {"source": description.source,
                                                  "architecture": description.architecture}})
    size = parsed.input_size
    preprocessing = Preprocessing(parsed.resize_size, size, parsed.mean, parsed.std)
    int8 = (None if settings.int8 is None
            else Int8Request(settings.int8, preprocessing, int8_images, force_int8))
    return CompileRequest(parsed.precision, settings.cpu_target, description.serving.batch_size,
                          (3, size, size), parsed.channels_last, parsed.resize_size, settings.engines, int8)


def detector_compile_request(description: ModelDescription) -> CompileRequest | None:
    """A detector's `compile:`: its backbone and head, fp32, for the engines it names, at the
    fixed input size of its architecture (an SSD-family torchvision detector: BuildError for
    any other)."""
    detection = description.handler_options.get("detection") or {}
    try:
        settings = parse_detector_compile(description.handler_options.get("compile"),
                                          detection.get("output"))
    except SettingsError as error:
        raise BuildError(f"{description.name}: {error}") from None
    if settings is None:
        return None
    if description.source == "ultralytics":
        height, width = parse_input_hw(detection.get("input_size"), "detection.input_size")
        return CompileRequest("fp32", settings.cpu_target, description.serving.batch_size,
                              (3, height, width), False, height, settings.engines)
    if description.source not in ("torchvision", "project"):
        raise BuildError(f"{description.name}: 'compile' applies to SSD-family detectors "
                         f"(source: torchvision or project), not source {description.source!r}")
    try:
        height, width = ssd_input_size_hw(create_architecture(model_source(description, None)))
    except NotAnSsdDetector as error:
        raise BuildError(f"{description.name}: 'compile': {error}") from None
    return CompileRequest("fp32", settings.cpu_target, description.serving.batch_size,
                          (3, height, width), False, height, settings.engines)


@dataclass(frozen=True)
class CompiledModels:
    """What the builder compiled into an archive, and the runner order it records."""

    packages: tuple[CompiledPackage, ...] = ()
    engine_models: tuple[EngineModel, ...] = ()
    runner_order: dict[str, list[str]] | None = None
    int8_gate: Int8Gate | None = None


def built_runners(names: Sequence[RunnerName], request: CompileRequest) -> list[str]:
    """The runners of `names` whose models `request` builds."""
    return [str(name) for name in names if name.engine in request.engines
            and (name.precision != "int8" or request.int8 is not None)]


def compiled_models(description: ModelDescription, request: CompileRequest | None,
                    num_classes: int | None, weights: Path, directory: Path) -> CompiledModels:
    """Build the models `request` asks for into `directory` (nothing for None), and the order
    its workers walk: `compile.runner_order`, else the project's default, less the runners of
    engines not built. The int8 gate's verdict is logged (torchserve_vision.archives)."""
    if request is None:
        return CompiledModels()
    detector = description.kind.network == "detector"
    if description.source == "ultralytics":
        exports = export_ultralytics_engines(weights, request, directory)
        order = {kind: built_runners(names, request) for kind, names in
                 parse_runner_order(DEFAULT_ULTRALYTICS_RUNNER_ORDER).items()}
        return CompiledModels((), exports.models, order)
    model = without_inplace_activations(load_model(model_source(description, num_classes), weights,
                                                   torch.device("cpu")))
    try:
        if detector:
            packages, exports = [], export_detector_engines(model, request, directory)
        else:
            packages = compile_packages(model, request, directory)
            exports = export_engine_models(model, request, directory)
    except (Int8GateFailed, PhotoSetError) as error:
        raise BuildError(f"{description.name}: {error}") from None
    except Exception as error:  # noqa: BLE001 - export, Inductor and the converters raise many kinds
        raise BuildError(f"{description.name}: ahead-of-time compilation failed: "
                         f"{type(error).__name__}: {error}") from None
    if exports.int8_gate is not None:
        logger.info("%s: %s", description.name, exports.int8_gate.summary())
    settings = parse_compile(description.handler_options.get("compile"))
    table = (settings.runner_order if settings and settings.runner_order
             else parse_runner_order(DEFAULT_DETECTOR_RUNNER_ORDER if detector else DEFAULT_RUNNER_ORDER))
    order = {kind: built_runners(names, request) for kind, names in table.items()}
    return CompiledModels(tuple(packages), exports.models, order, exports.int8_gate)


# --- the archive --------------------------------------------------------------------------------
def handler_section(description: ModelDescription, num_classes: int | None,
                    compiled: CompiledModels = CompiledModels(),
                    target: BuildTarget = "cpu") -> dict[str, Any]:
    """The archive YAML's `handler:` section, validated with the handler's own parser. A
    classifier built for GPU workers decodes every JPEG in full unless its description says
    otherwise (`jpeg_draft: false`): reduced-scale decoding is the CPU's (Pillow's), and a GPU
    worker honours it by decoding those JPEGs on the CPU (handlers.request.decode)."""
    section = dict(description.handler_options)
    if target == "gpu" and description.kind.network == "classifier":
        section.setdefault("jpeg_draft", False)
    section["model"] = {"source": description.source, "architecture": description.architecture,
                        "num_classes": num_classes, "kwargs": dict(description.builder_kwargs)}
    section["labels_file"] = "labels.json"
    if compiled.packages:
        section["compiled_packages"] = [{"file": package.file, "target": package.target.to_dict()}
                                        for package in compiled.packages]
    if compiled.engine_models:
        section["engine_models"] = [{"engine": model.engine, "file": model.file, "weights": model.weights}
                                    for model in compiled.engine_models]
    if compiled.int8_gate is not None:
        section["int8_gate"] = compiled.int8_gate.to_dict()
    if compiled.runner_order is not None:
        section["runner_order"] = compiled.runner_order
    try:
        description.kind.parse_settings(section)
    except SettingsError as error:
        raise BuildError(f"{description.name}: {error}") from None
    return section


def stage_files(description: ModelDescription, staging: Path, target: BuildTarget = "cpu",
                int8_images: Path | None = None, force_int8: bool = False) -> Path:
    """Write weights, labels, YAML and the handlers package into `staging`; return the weights.
    For the `gpu` target no CPU package is compiled (GPU workers refuse them all)."""
    description, export = with_export(description)
    request = compile_request(description, int8_images, force_int8)  # checked before any weights
    if target == "gpu":
        request = None
    if export is not None:
        labels = export_labels(description, export)
    else:
        try:
            labels = resolve_labels(description.labels)
        except DescriptionError as error:
            raise BuildError(f"{description.name}: {error}") from None
    num_classes = description.num_classes
    if description.source in STATE_DICT_SOURCES:
        num_classes = num_classes or len(labels)
        if num_classes != len(labels):
            raise BuildError(f"{description.name}: num_classes={num_classes} but "
                             f"{len(labels)} labels")
    check_architecture(description)
    weights = staging / SERIALIZED_NAMES[description.source]
    if export is not None:
        weights = weights.with_name(ULTRALYTICS_ONNX_NAME) if export.format == "onnx" else weights
        shutil.copyfile(export.path, weights)
    elif description.source in STATE_DICT_SOURCES:
        write_state_dict(description, num_classes or len(labels), weights)
    else:
        copy_program(description, weights)
    extra = staging / "extra"
    shutil.copytree(HANDLER_PACKAGE, extra / "handlers",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (extra / "labels.json").write_text(json.dumps(labels), encoding="utf-8")
    compiled = compiled_models(description, request, num_classes, weights, extra / COMPILED_DIRECTORY)
    model_yaml = {**frontend_settings(description),
                  "handler": handler_section(description, num_classes, compiled, target)}
    (staging / "model-config.yaml").write_text(yaml.safe_dump(model_yaml), encoding="utf-8")
    return weights


def frontend_settings(description: ModelDescription) -> dict[str, Any]:
    """Top-level keys of the archive's YAML that TorchServe's frontend reads. It takes the
    timeouts from the archive whenever the archive has a YAML (120 s when the YAML omits them),
    whatever config.properties says; the version's own queue size (`jobQueueSize`, over the
    server's `job_queue_size`) too; workers and batch settings stay with the register call and
    `models=`, which scale and rollouts change; queued batching and its deadline are switched on
    here, for the frontend agent (torchserve_vision/frontend). `handler.continuous_batching` (TorchServe's
    asynchronous worker mode, handlers/continuous_serving.py) is refused: see the message."""
    serving = description.serving
    settings: dict[str, Any] = {"startupTimeout": serving.startup_timeout_s,
                                "responseTimeout": serving.response_timeout_s}
    if serving.job_queue_size:
        settings["jobQueueSize"] = serving.job_queue_size     # this version's queue
    if serving.batching == QUEUED:
        settings["continuousBatching"] = True   # the frontend agent's queued batching
        settings["clientTimeoutInMills"] = serving.deadline_ms   # its deadlines (0: none)
    if description.handler_options.get("continuous_batching"):
        raise BuildError(f"{description.name}: continuous batching is measured in the lab only "
                         "(torchserve-vision lab policies): TorchServe 0.12's asynchronous frontend "
                         "keeps every answered request in its map of jobs in the worker, so "
                         "unregistering or scaling down a version that served 100 requests fails "
                         "with 'Deque full' (docs/benchmarks.md, batching policies)")
    return settings


def run_archiver(description: ModelDescription, staging: Path, weights: Path | None, store: Path,
                 handler: Path | None = None) -> Path:
    """Run the real torch-model-archiver; return the archive's path in the model store.
    `weights`: None for a pipeline (its stages' weights are extra files). `handler`: an entry
    module of one's own instead of the task's (it must be inside `staging/extra`, so that it
    lands in the archive)."""
    handler = handler or staging / "extra" / "handlers" / description.kind.entry_module
    command = [
        str(ARCHIVER), "--model-name", description.name, "--version", description.version,
        *(["--serialized-file", str(weights)] if weights is not None else []),
        "--handler", str(handler),
        "--extra-files", str(staging / "extra"),
        "--config-file", str(staging / "model-config.yaml"),
        "--export-path", str(staging), "--force", "--archive-format", ARCHIVE_FORMAT,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"torch-model-archiver failed for {description.name}:\n"
                         f"{result.stdout}{result.stderr}")
    store.mkdir(parents=True, exist_ok=True)
    target = store / description.archive_name
    shutil.move(str(staging / f"{description.name}.mar"), target)
    return target


def stage_pipeline_files(description: ModelDescription, store: Path, staging: Path) -> None:
    """A pipeline's stages (archives in `store`), YAML and the handlers package into `staging`."""
    extra = staging / "extra"
    try:
        section = pipeline_handler_section(description, store, extra)
    except PipelineError as error:
        raise BuildError(str(error)) from None
    shutil.copytree(HANDLER_PACKAGE, extra / "handlers",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    model_yaml = {**frontend_settings(description), "handler": section}
    (staging / "model-config.yaml").write_text(yaml.safe_dump(model_yaml), encoding="utf-8")


def build_archive(description: ModelDescription, store: Path, target: BuildTarget = "cpu",
                  int8_images: Path | None = None, force_int8: bool = False,
                  reference_requests: int = REFERENCE_REQUESTS) -> Path:
    """Build one archive into `store` (replacing an older build of the same name and version).
    A pipeline's stage archives must be in `store` already. `target`: the workers that will
    serve it; `gpu` leaves out the ahead-of-time CPU packages (see BUILD_TARGETS).
    `int8_images`: the photos `compile.int8` calibrates and gates on and the drift reference
    profile is recorded from (None: the project's);
    `force_int8`: keep an int8 model that fails its gate. `reference_requests`: how many
    requests the drift reference profile is recorded from (0: the archive has none)."""
    with tempfile.TemporaryDirectory(prefix=f"build-{description.name}-") as tmp:
        staging = Path(tmp)
        if description.is_pipeline:
            stage_pipeline_files(description, store, staging)
            return run_archiver(description, staging, None, store)
        weights = stage_files(description, staging, target, int8_images, force_int8)
        archive = run_archiver(description, staging, weights, store)
    if description.kind.task in FEATURES_OF_TASK and reference_requests > 0:
        add_reference_profile(archive, description, int8_images, reference_requests)
    return archive


def add_reference_profile(archive: Path, description: ModelDescription, images_dir: Path | None,
                          count: int) -> None:
    """Record the drift reference profile of the archive's model from `count` requests and store
    it in the archive (torchserve_vision.archives.drift_reference)."""
    bodies = reference_bodies(images_dir, count)
    try:
        profile = record_profile(archive, description.kind.task, bodies,
                                 profile_source(images_dir, len(bodies)))
    except (PhotoSetError, ValueError) as error:
        archive.unlink()
        raise BuildError(f"{description.name}: recording the drift reference profile failed: "
                         f"{error}") from None
    add_profile(archive, profile)
    logger.info("%s: drift reference profile from %s", description.name, profile.source)
