"""Each model kind's request options, as frozen dataclasses (their parsers: `handlers.request`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EscalationMode = Literal["auto", "never", "always"]


@dataclass(frozen=True)
class DetectionOptions:
    """What one request asks for: thresholds, a cap, an optional class filter and, for a
    YOLO-style model, whether its NMS ignores classes."""

    score_threshold: float
    iou_threshold: float
    max_detections: int
    classes: frozenset[int] | None = None
    agnostic_nms: bool = False


@dataclass(frozen=True)
class ClassificationOptions:
    """How many of the most probable classes a request asks for."""

    top_k: int


@dataclass(frozen=True)
class CascadeOptions:
    """How many classes a request wants and how it escalates (`threshold` applies to `auto`)."""

    top_k: int
    escalation: EscalationMode
    threshold: float


@dataclass(frozen=True)
class BoxOptions:
    """Which of a request's detections are classified, and how many classes each gets."""

    max_boxes: int
    classes: frozenset[int] | None   # detector class indices; None: every class
    top_k: int


@dataclass(frozen=True)
class DetectClassifyOptions:
    """A request's detection options and which of its boxes are classified."""

    detection: DetectionOptions
    boxes: BoxOptions
