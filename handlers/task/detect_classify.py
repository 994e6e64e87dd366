"""Detect-then-classify data and the choice of boxes to classify (pure; the handler is in
`handlers.detect_then_classify`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from handlers.ground.decoded_requests import DecodedImage
from handlers.ground.kind_options import BoxOptions, DetectClassifyOptions
from handlers.task.detection import DetectionTensors, DetectorInput


@dataclass(frozen=True)
class PipelineInput:
    detector_input: DetectorInput
    requests: Sequence[DecodedImage[DetectClassifyOptions]]


@dataclass(frozen=True)
class PipelineOutput:
    """Each image's detections, which of them were classified (row indices), and their logits
    (`float[n_i, C]`, aligned with those indices)."""

    detections: list[DetectionTensors]
    classified: list[list[int]]
    logits: list[torch.Tensor]


def boxes_to_classify(detections: DetectionTensors, options: BoxOptions) -> list[int]:
    """Row indices (best first, as the detections are ordered) of the boxes to classify: the
    first `max_boxes` whose class is in `options.classes` (any class when None)."""
    rows = range(detections.scores.shape[0])
    if options.classes is not None:
        classes = detections.class_indices.tolist()
        rows = [row for row in rows if classes[row] in options.classes]  # type: ignore[assignment]
    return list(rows)[: options.max_boxes]
