"""Settings of the pipeline archives, parsed once from the `handler:` section of their YAML.

A pipeline archive holds the models of other archives ("stages"), each in its own directory with
its weights, class names, compiled packages and its archive's own `handler:` section:

    handler:
      stages:
        first:  {archive: efficientnet_lite0-1.0, directory: stages/first,
                 serialized_file: model.pt, handler: {...}}
        second: {...}
      escalation: {rule: probability, threshold: 0.5}       # cascade
      top_k: 5
      limits: {...}                                          # the pipeline's own request limits

`torchserve-vision build` writes this from the stage archives (see
torchserve_vision/archives/pipelines.py). Bad values raise SettingsError at load time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from handlers.ground.escalation import Escalation, EscalationRule
from handlers.ground.kind_options import DetectionOptions
from handlers.ground.limits import ImageLimits, SettingsError
from handlers.model.settings import (
    ClassifierSettings,
    DetectorSettings,
    _choice,
    _fraction_setting,
    _positive_int,
    parse_classifier_settings,
    parse_cuda_preprocess_kernels,
    parse_detector_settings,
    parse_jpeg_decoder,
    parse_limits,
)
from handlers.request.jpeg_batches import JpegDecoder

CASCADE_STAGES = ("first", "second")
DETECT_CLASSIFY_STAGES = ("detector", "classifier")


@dataclass(frozen=True)
class StageArchive:
    """One stage as the pipeline archive holds it: the archive it came from (`<name>-<version>`),
    its directory inside the model directory, its weights file name, its `handler:` section."""

    archive: str
    directory: str
    serialized_file: str
    handler: Mapping[str, Any]


@dataclass(frozen=True)
class CascadeSettings:
    first: StageArchive
    second: StageArchive
    first_classifier: ClassifierSettings
    second_classifier: ClassifierSettings
    escalation: Escalation
    top_k: int
    limits: ImageLimits
    jpeg_decoder: JpegDecoder = field(default="torchvision", kw_only=True)
    cuda_preprocess_kernels: bool = field(default=False, kw_only=True)


@dataclass(frozen=True)
class DetectClassifySettings:
    detector: StageArchive
    classifier: StageArchive
    detector_settings: DetectorSettings
    classifier_settings: ClassifierSettings
    max_boxes: int            # default per request: the best boxes (by score) classified
    max_boxes_cap: int        # the most a request may ask for
    classify_batch_size: int  # boxes classified per forward pass (all boxes of the batch, chunked)
    top_k: int
    limits: ImageLimits
    jpeg_decoder: JpegDecoder = field(default="torchvision", kw_only=True)
    cuda_preprocess_kernels: bool = field(default=False, kw_only=True)

    @property
    def detection_defaults(self) -> DetectionOptions:
        return self.detector_settings.defaults


def parse_stage(section: Any, role: str) -> StageArchive:
    if not isinstance(section, Mapping):
        raise SettingsError(f"'stages.{role}' must be a mapping, got {section!r}")
    missing = {"archive", "directory", "serialized_file", "handler"} - set(section)
    if missing:
        raise SettingsError(f"'stages.{role}' lacks {sorted(missing)}")
    return StageArchive(str(section["archive"]), str(section["directory"]),
                        str(section["serialized_file"]), dict(section["handler"]))


def parse_stages(handler_section: Mapping[str, Any], roles: tuple[str, ...]) -> dict[str, StageArchive]:
    stages = handler_section.get("stages")
    if not isinstance(stages, Mapping) or set(stages) != set(roles):
        raise SettingsError(f"'stages' must name exactly {', '.join(roles)}; got {stages!r}")
    return {role: parse_stage(stages[role], role) for role in roles}


def parse_escalation(section: Any) -> Escalation:
    if not isinstance(section, Mapping):
        raise SettingsError(f"'escalation' must be a mapping with 'rule' and 'threshold', got {section!r}")
    return Escalation(_choice(section.get("rule", "probability"), "escalation.rule", EscalationRule),
                      _fraction_setting(section.get("threshold", 0.5), "escalation.threshold"))


def parse_cascade_settings(handler_section: Mapping[str, Any] | None) -> CascadeSettings:
    """The `handler:` section of a cascade archive; both stages must have the same classes."""
    if not handler_section:
        raise SettingsError("the archive's YAML has no 'handler:' section")
    stages = parse_stages(handler_section, CASCADE_STAGES)
    first = parse_classifier_settings(stages["first"].handler)
    second = parse_classifier_settings(stages["second"].handler)
    return CascadeSettings(
        first=stages["first"], second=stages["second"],
        first_classifier=first, second_classifier=second,
        escalation=parse_escalation(handler_section.get("escalation", {})),
        top_k=_positive_int(handler_section.get("top_k", first.top_k), "top_k"),
        limits=parse_limits(handler_section.get("limits", {})),
        jpeg_decoder=parse_jpeg_decoder(handler_section),
        cuda_preprocess_kernels=parse_cuda_preprocess_kernels(handler_section),
    )


def parse_detect_classify_settings(handler_section: Mapping[str, Any] | None) -> DetectClassifySettings:
    """The `handler:` section of a detect-then-classify archive."""
    if not handler_section:
        raise SettingsError("the archive's YAML has no 'handler:' section")
    stages = parse_stages(handler_section, DETECT_CLASSIFY_STAGES)
    boxes = handler_section.get("boxes", {})
    cap = _positive_int(boxes.get("max_boxes_cap", 100), "boxes.max_boxes_cap")
    max_boxes = _positive_int(boxes.get("max_boxes", 20), "boxes.max_boxes")
    if max_boxes > cap:
        raise SettingsError(f"'boxes.max_boxes' ({max_boxes}) exceeds 'boxes.max_boxes_cap' ({cap})")
    return DetectClassifySettings(
        detector=stages["detector"], classifier=stages["classifier"],
        detector_settings=parse_detector_settings(stages["detector"].handler),
        classifier_settings=parse_classifier_settings(stages["classifier"].handler),
        max_boxes=max_boxes, max_boxes_cap=cap,
        classify_batch_size=_positive_int(boxes.get("classify_batch_size", 32),
                                          "boxes.classify_batch_size"),
        top_k=_positive_int(handler_section.get("top_k", 3), "top_k"),
        limits=parse_limits(handler_section.get("limits", {})),
        jpeg_decoder=parse_jpeg_decoder(handler_section),
        cuda_preprocess_kernels=parse_cuda_preprocess_kernels(handler_section),
    )
