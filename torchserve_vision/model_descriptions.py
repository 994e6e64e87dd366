"""Model descriptions (`config/models.yaml`): what each archive holds and how it is served.

A description names the network (source, architecture, weights), its class names, the handler's
options (written into the archive's YAML) and its serving settings (batch size, delay, workers,
timeouts), which go into config.properties' `models=` and into every register call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from torchserve_vision.errors import CommandError
from torchserve_vision.model_kinds import KINDS, ModelKind, UnknownKind, kind_of

# The weights file of an archive, by `model.source`.
SERIALIZED_NAMES = {"timm": "model.pt", "torchvision": "model.pt", "project": "model.pt",
                    "torchscript": "model.ts.pt", "export": "model.pt2", "ultralytics": "model.ts.pt"}
# An Ultralytics export's file in its archive by its format (handlers.model.model_loading reads it so).
ULTRALYTICS_ONNX_NAME = "model.onnx"
# `labels:` of an Ultralytics export's description: the class names its metadata carries.
EXPORT_LABELS = "export"


class DescriptionError(CommandError, ValueError):
    """A model description is incomplete or names something that does not exist."""


DELAYED, QUEUED = "delayed", "queued"
BATCHING_POLICIES = (DELAYED, QUEUED)
# The delay TorchServe is given for a model with queued batching: the frontend agent ignores it;
# a TorchServe started without the agent batches with it, and 1 ms is the best fixed delay
# measured (docs/benchmarks.md, "Batching policies"). Never 0: TorchServe 0.12 reads a
# maxBatchDelay of 0 in config.properties' models= as unset, i.e. its 100 ms default.
QUEUED_FALLBACK_DELAY_MS = 1


@dataclass(frozen=True)
class ServingSettings:
    """Batch and worker settings of a model version (TorchServe fixes them at registration);
    also the `serving:` section of config/models.yaml.

    `batching`: how the frontend gathers a batch. `queued` (the default) takes what is queued
    when a worker is free and never waits: the frontend agent's (torchserve_vision/frontend),
    switched on by the archive's YAML, so it is fixed per archive; its `max_batch_delay_ms` is
    always QUEUED_FALLBACK_DELAY_MS (whatever was given: the agent does not wait; it is what
    TorchServe's own batching uses where the agent is missing). `delayed` is TorchServe's own:
    the first request, then up to `max_batch_delay_ms` of waiting for more.

    `deadline_ms`: a request that waited longer in the queue is answered 504 and never computed
    (0: no deadline); a client's X-Request-Timeout-Ms header shortens it for its request. The
    archive's YAML carries it as TorchServe's `clientTimeoutInMills`, which only the frontend
    agent's queued batching answers (TorchServe's own batching drops such a request without an
    answer): so it needs `batching: queued`.

    `job_queue_size`: requests this version queues before it answers 503 (0: the server's
    `job_queue_size`). Carried in the archive's YAML as TorchServe's `jobQueueSize`, which
    TorchServe honours per model version (the register call cannot set it): a change is a new
    archive or a new version of the same one (`models rollout --same-archive --job-queue-size N`).
    Size it as the version's capacity x the queueing delay accepted (docs/robustness.md).
    """

    batch_size: int = 8
    max_batch_delay_ms: int = 20
    min_workers: int = 1
    max_workers: int = 1
    response_timeout_s: int = 60
    startup_timeout_s: int = 120    # TorchServe kills a worker that takes longer to load
    batching: str = QUEUED
    deadline_ms: int = 0
    job_queue_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.job_queue_size, int) or isinstance(self.job_queue_size, bool) \
                or self.job_queue_size < 0:
            raise DescriptionError(f"serving.job_queue_size {self.job_queue_size!r}: a whole number of "
                                   "requests, 0 for the server's job_queue_size")
        if self.batching not in BATCHING_POLICIES:
            raise DescriptionError(f"serving.batching {self.batching!r}: use "
                                   f"{' or '.join(BATCHING_POLICIES)}")
        if not isinstance(self.deadline_ms, int) or isinstance(self.deadline_ms, bool) \
                or self.deadline_ms < 0:
            raise DescriptionError(f"serving.deadline_ms {self.deadline_ms!r}: a whole number of "
                                   "milliseconds, 0 for none")
        if self.deadline_ms and self.batching != QUEUED:
            raise DescriptionError("serving.deadline_ms needs batching: queued (TorchServe's own "
                                   "batching drops an expired request without answering it)")
        if self.batching == QUEUED:
            object.__setattr__(self, "max_batch_delay_ms", QUEUED_FALLBACK_DELAY_MS)

    @classmethod
    def of_version(cls, description: dict[str, Any]) -> ServingSettings:
        """The settings of a version as TorchServe's `describe` reports them (with queued
        batching, any delay reads as QUEUED_FALLBACK_DELAY_MS: a server started from an older
        config.properties reports 100 ms for the 0 it gave). A deadline is read only where
        queued batching answers it. The queue's size is left at 0: the version's own, if any,
        stays in its archive."""
        queued = bool(description.get("continuousBatching"))
        return cls(description["batchSize"], description["maxBatchDelay"],
                   description["minWorkers"], description["maxWorkers"],
                   description["responseTimeout"],
                   description.get("startupTimeout", cls.startup_timeout_s),
                   QUEUED if queued else DELAYED,
                   int(description.get("clientTimeoutInMills") or 0) if queued else 0)


@dataclass(frozen=True)
class ModelDescription:
    name: str
    version: str
    task: str
    source: str                 # "pipeline" for a pipeline task
    architecture: str | None
    weights: str
    labels: str                 # "" for a pipeline (its stages have their own)
    num_classes: int | None = None
    builder_kwargs: Mapping[str, Any] = field(default_factory=dict)
    handler_options: Mapping[str, Any] = field(default_factory=dict)
    serving: ServingSettings = field(default_factory=ServingSettings)
    stages: Mapping[str, str] = field(default_factory=dict)  # pipeline: role -> stage archive
    # Loaded when the server starts (load_models=); false: built, and registered on demand.
    start: bool = True

    @property
    def archive_name(self) -> str:
        return f"{self.name}-{self.version}.mar"

    @property
    def kind(self) -> ModelKind:
        return kind_of(self.task)

    @property
    def is_pipeline(self) -> bool:
        return self.kind.is_pipeline


def parse_pipeline_description(raw: Mapping[str, Any]) -> ModelDescription:
    """A pipeline entry: `stages` (role -> `<name>-<version>` of a stage archive) instead of `model`.
    Pipelines hold the models of other archives in the model store, not a network of their own."""
    task = str(raw["task"])
    stages = raw.get("stages")
    roles = tuple(KINDS[task].stages)
    if not isinstance(stages, Mapping) or set(stages) != set(roles):
        raise DescriptionError(f"{raw.get('name', '?')}: a {task} needs 'stages' with exactly "
                               f"{', '.join(roles)} (each a <name>-<version> archive); got {stages!r}")
    return ModelDescription(
        name=str(raw["name"]), version=str(raw.get("version", "1.0")), task=task,
        source="pipeline", architecture=None, weights="", labels="",
        handler_options=dict(raw.get("handler", {})),
        serving=ServingSettings(**raw.get("serving", {})),
        stages={role: str(stages[role]).removesuffix(".mar") for role in roles},
        start=bool(raw.get("start", True)),
    )


def parse_description(raw: Mapping[str, Any]) -> ModelDescription:
    """One entry of models.yaml -> ModelDescription; DescriptionError naming what is missing or wrong."""
    try:
        kind = kind_of(str(raw.get("task", "classification")))
        if kind.is_pipeline:
            return parse_pipeline_description(raw)
        model = raw["model"]
        labels = raw.get("labels", EXPORT_LABELS if model.get("source") == "ultralytics" else None)
        if labels is None:
            raise KeyError("labels")
        description = ModelDescription(
            name=str(raw["name"]),
            version=str(raw.get("version", "1.0")),
            task=str(raw.get("task", "classification")),
            source=str(model["source"]),
            architecture=model.get("architecture"),
            weights=str(model["weights"]),
            labels=str(labels),
            num_classes=model.get("num_classes"),
            builder_kwargs=dict(model.get("kwargs") or {}),
            handler_options=dict(raw.get("handler", {})),
            serving=ServingSettings(**raw.get("serving", {})),
            start=bool(raw.get("start", True)),
        )
    except KeyError as error:
        raise DescriptionError(f"model description {raw.get('name', '?')!r} lacks {error}") from None
    except (TypeError, UnknownKind) as error:
        raise DescriptionError(f"model description {raw.get('name', '?')!r}: {error}") from None
    return description


def with_settings_of(new: ModelDescription, base: ModelDescription) -> ModelDescription:
    """`new`'s network, class names and version with `base`'s handler options (preprocessing,
    precision, channels_last, torch_threads, compile, limits, ...) and serving settings; an option
    `new` sets itself wins, one level deep (e.g. `preprocess.input_size` alone). For a version
    built from flags of a model that config/models.yaml describes: it keeps that model's
    performance and normalisation settings unless the flags say otherwise."""
    if new.task != base.task:
        raise DescriptionError(f"{new.name}: a {new.task} model cannot take the settings of the "
                               f"{base.task} model of the same name")
    options: dict[str, Any] = dict(base.handler_options)
    for key, value in new.handler_options.items():
        inherited = options.get(key)
        if isinstance(value, Mapping) and isinstance(inherited, Mapping):
            options[key] = {**inherited, **value}
        else:
            options[key] = value
    return replace(new, handler_options=options, serving=base.serving)


def load_descriptions(path: Path) -> list[ModelDescription]:
    if not path.is_file():
        raise DescriptionError(f"no model description file at {path}")
    document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return [parse_description(raw) for raw in document.get("models", [])]


def resolve_labels(spec: str) -> list[str]:
    """`imagenet` / `coco`: class names from torchvision's weight metadata; else a labels file."""
    if spec == "imagenet":
        from torchvision.models import ResNet50_Weights

        return list(ResNet50_Weights.DEFAULT.meta["categories"])
    if spec == "coco":
        from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights

        return list(FasterRCNN_ResNet50_FPN_Weights.DEFAULT.meta["categories"])
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DescriptionError(f"labels file not found: {path} (or use 'imagenet' / 'coco')")
    from handlers.model.model_loading import load_labels

    try:
        return load_labels(path)
    except ValueError as error:
        raise DescriptionError(str(error)) from None
