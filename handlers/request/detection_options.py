"""Per-request detection options, from a JSON body, multipart form fields or request headers.

    JSON body:   {"data": "<base64>", "score_threshold": 0.5, "max_detections": 10,
                  "classes": ["person", "dog"], "iou_threshold": 0.5, "agnostic_nms": true}
    form fields: score_threshold=0.5, classes=person,dog (beside the image field)
    headers:     X-Score-Threshold: 0.5, X-IoU-Threshold: 0.5, X-Max-Detections: 10,
                 X-Classes: person,dog, X-Agnostic-NMS: true

A value in the body beats a header, a header beats the archive's default. Classes are names from
the model's labels or class indices. The IoU threshold and class-agnostic NMS are a YOLO-style
model's (its NMS runs here); a torchvision detector runs its own NMS and an end-to-end export
needs none, so a request asking them for class-agnostic NMS is refused. A malformed or
out-of-range value is a 400 for that request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from handlers.ground.kind_options import DetectionOptions
from handlers.request.request_options import (
    invalid_option,
    option_values,
    parse_count,
    parse_fraction,
    parse_switch,
)

OPTION_HEADERS = {
    "score_threshold": "X-Score-Threshold",
    "iou_threshold": "X-IoU-Threshold",
    "max_detections": "X-Max-Detections",
    "classes": "X-Classes",
    "agnostic_nms": "X-Agnostic-NMS",
}
OPTION_FIELDS = frozenset(OPTION_HEADERS)


def _class_index(name: str, item: object, labels: Sequence[str]) -> int:
    text = str(item).strip()
    if (isinstance(item, int) and not isinstance(item, bool)) or text.isdigit():
        index = int(text)
        if 0 <= index < len(labels):
            return index
        raise invalid_option(name, item, f"a class index from 0 to {len(labels) - 1}")
    matches = [i for i, label in enumerate(labels) if label == text]
    matches = matches or [i for i, label in enumerate(labels) if label.lower() == text.lower()]
    if not matches:
        raise invalid_option(name, item, "names from the model's labels or class indices")
    return matches[0]


def parse_class_set(name: str, value: object, labels: Sequence[str]) -> frozenset[int]:
    """A list (or comma-separated text) of class names or indices -> class indices."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise invalid_option(name, value, "a non-empty list of class names or indices")
    return frozenset(_class_index(name, item, labels) for item in items)


def parse_detection_options(row: Mapping[str, Any], header: Callable[[str], str | None],
                            defaults: DetectionOptions, labels: Sequence[str],
                            max_detections_cap: int, nms_here: bool = True) -> DetectionOptions:
    """This request's options: its own values over `defaults`; ClientError(400) when invalid.
    `nms_here`: the handler runs the model's NMS (a YOLO-style model), so class-agnostic NMS can
    be asked for."""
    values = option_values(row, header, OPTION_HEADERS)
    agnostic = (parse_switch("agnostic_nms", values["agnostic_nms"]) if "agnostic_nms" in values
                else defaults.agnostic_nms)
    if agnostic and not nms_here:
        raise invalid_option("agnostic_nms", values.get("agnostic_nms"),
                             "false: this detector's NMS is not run here (a torchvision detector runs "
                             "its own, an end-to-end export needs none)")
    return DetectionOptions(
        score_threshold=parse_fraction("score_threshold", values["score_threshold"])
        if "score_threshold" in values else defaults.score_threshold,
        iou_threshold=parse_fraction("iou_threshold", values["iou_threshold"], allow_zero=False)
        if "iou_threshold" in values else defaults.iou_threshold,
        max_detections=parse_count("max_detections", values["max_detections"], max_detections_cap)
        if "max_detections" in values else defaults.max_detections,
        classes=parse_class_set("classes", values["classes"], labels)
        if "classes" in values else defaults.classes,
        agnostic_nms=agnostic,
    )
