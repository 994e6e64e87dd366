"""Per-request options of the detect-then-classify pipeline: the detector's own (see
`handlers.request.detection_options`) plus, from a JSON body, form fields or headers:

    max_boxes / X-Max-Boxes: 5            the best boxes (by score) to classify
    classify_classes / X-Classify-Classes: person,dog
                                          only boxes of these detector classes are classified
    top_k / X-Top-K: 3                    classes per classified box

A body value beats a header; a malformed value is a 400 for that request alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from handlers.ground.kind_options import BoxOptions, DetectClassifyOptions, DetectionOptions
from handlers.request.classification_options import top_k_option
from handlers.request.detection_options import OPTION_HEADERS as DETECTION_HEADERS
from handlers.request.detection_options import parse_class_set, parse_detection_options
from handlers.request.request_options import option_values, parse_count

BOX_HEADERS = {"max_boxes": "X-Max-Boxes", "classify_classes": "X-Classify-Classes",
               "top_k": "X-Top-K"}
OPTION_FIELDS = frozenset(DETECTION_HEADERS) | frozenset(BOX_HEADERS)


class DetectorCaps(Protocol):
    @property
    def max_detections_cap(self) -> int: ...

    @property
    def runs_nms(self) -> bool: ...


class DetectClassifyDefaults(Protocol):
    """What the options read of the pipeline's settings (`handlers.model.pipeline_settings.
    DetectClassifySettings` is one): each option's default and cap."""

    @property
    def max_boxes(self) -> int: ...

    @property
    def max_boxes_cap(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    @property
    def detection_defaults(self) -> DetectionOptions: ...

    @property
    def detector_settings(self) -> DetectorCaps: ...


def parse_box_options(row: Mapping[str, Any], header: Callable[[str], str | None],
                      settings: DetectClassifyDefaults, detector_labels: Sequence[str],
                      classifier_class_count: int) -> BoxOptions:
    values = option_values(row, header, BOX_HEADERS)
    return BoxOptions(
        max_boxes=parse_count("max_boxes", values["max_boxes"], settings.max_boxes_cap)
        if "max_boxes" in values else settings.max_boxes,
        classes=parse_class_set("classify_classes", values["classify_classes"], detector_labels)
        if "classify_classes" in values else None,
        top_k=top_k_option(values, settings.top_k, classifier_class_count),
    )


def parse_detect_classify_options(row: Mapping[str, Any], header: Callable[[str], str | None],
                                  settings: DetectClassifyDefaults, detector_labels: Sequence[str],
                                  classifier_class_count: int) -> DetectClassifyOptions:
    """This request's options; ClientError(400) when invalid."""
    detector = settings.detector_settings
    detection = parse_detection_options(row, header, settings.detection_defaults, detector_labels,
                                        detector.max_detections_cap,
                                        nms_here=detector.runs_nms)
    return DetectClassifyOptions(detection, parse_box_options(row, header, settings, detector_labels,
                                                              classifier_class_count))
