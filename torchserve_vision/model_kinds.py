"""The one table of model kinds: what each `task:` of config/models.yaml is, for every place that
needs to know (descriptions, the archive builder, pipelines, the command's flags, the lab's
in-process handlers, rollouts' smoke tests).

Adding a kind is an entry here plus its own modules in handlers/ (an entry module with one
handler class, a settings parser, a frozen request-options dataclass). Importing this module
imports no torch: the handler code it names is imported only when asked for
(`parse_settings`, `handler_class`, `options_type`). tests/unit/test_model_kinds.py checks that
every entry is complete.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Network = Literal["classifier", "detector"]


def best_label(answer: Any) -> str | None:
    """The best class (a classifier's answer, best first) or the best detection's label (a
    detector's, best first); None for an empty or unexpected answer."""
    if isinstance(answer, list) and answer and isinstance(answer[0], dict):
        return str(answer[0].get("label"))
    return None


def import_attribute(path: str) -> Any:
    """`package.module:name` -> that attribute (imported on demand)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ModelKind:
    """One `task:`. `network`: what a single-network kind holds (None for a pipeline, whose
    `stages` map each role to the task of the archive it takes). `stages_share_classes`: the
    pipeline's stages must have the same class names (a cascade answers with either)."""

    task: str
    entry_module: str           # file in handlers/: the archive's --handler
    handler: str                # "handlers.<module>:<class>"
    settings_parser: str        # "handlers.<module>:<function>": the `handler:` section -> settings
    options: str                # "handlers.<module>:<class>": a request's options
    top_label: Callable[[Any], str | None]   # the best label of one answer (smoke tests)
    network: Network | None = None
    default_labels: str | None = None         # for `build --name` without --labels
    compiles: bool = False                    # a classifier's `compile:` (the whole network) applies
    stages: Mapping[str, str] = field(default_factory=dict)
    stages_share_classes: bool = False

    @property
    def is_pipeline(self) -> bool:
        return bool(self.stages)

    def parse_settings(self, handler_section: Mapping[str, Any]) -> object:
        """The handler's own parser (SettingsError when the section is bad)."""
        return import_attribute(self.settings_parser)(handler_section)

    def handler_class(self) -> type:
        return import_attribute(self.handler)

    def options_type(self) -> type:
        return import_attribute(self.options)


KINDS: dict[str, ModelKind] = {kind.task: kind for kind in (
    ModelKind("classification", "image_classifier.py",
              "handlers.image_classifier:ImageClassifierHandler",
              "handlers.model.settings:parse_classifier_settings",
              "handlers.ground.kind_options:ClassificationOptions",
              best_label, network="classifier", default_labels="imagenet", compiles=True),
    ModelKind("detection", "object_detector.py",
              "handlers.object_detector:ObjectDetectorHandler",
              "handlers.model.settings:parse_detector_settings",
              "handlers.ground.kind_options:DetectionOptions",
              best_label, network="detector", default_labels="coco"),
    ModelKind("cascade", "classification_cascade.py",
              "handlers.classification_cascade:ClassificationCascadeHandler",
              "handlers.model.pipeline_settings:parse_cascade_settings",
              "handlers.ground.kind_options:CascadeOptions",
              best_label, stages={"first": "classification", "second": "classification"},
              stages_share_classes=True),
    ModelKind("detect_then_classify", "detect_then_classify.py",
              "handlers.detect_then_classify:DetectThenClassifyHandler",
              "handlers.model.pipeline_settings:parse_detect_classify_settings",
              "handlers.ground.kind_options:DetectClassifyOptions",
              best_label, stages={"detector": "detection", "classifier": "classification"}),
)}


class UnknownKind(ValueError):
    """A task or handler module that no kind has."""


def kind_of(task: str) -> ModelKind:
    try:
        return KINDS[task]
    except KeyError:
        raise UnknownKind(f"unknown task {task!r}; known: {', '.join(KINDS)}") from None


def kind_of_entry_module(handler: str) -> ModelKind:
    """The kind whose archives have `handler` (a manifest's handler path) as entry module."""
    name = handler.replace("\\", "/").rsplit("/", 1)[-1]
    for kind in KINDS.values():
        if kind.entry_module == name:
            return kind
    raise UnknownKind(f"no model kind has the entry module {handler!r}")
