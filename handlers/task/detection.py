"""Detection data and postprocessing steps: per-request options, the three-tensor bundle of one
image's detections, YOLO-style candidate decoding, per-request selection, per-class NMS, JSON rows.

Boxes are `float[N, 4]` xyxy; scores `float[N]`; class indices `int64[N]`; all three stay on the
device they came from until `format_detections` moves the final few to the CPU. Which steps run
for which kind of model is decided in `handlers.model.detector_formats`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypedDict

import numpy as np
import torch
from torchvision.ops import batched_nms, box_convert, nms

from handlers.ground.kind_options import DetectionOptions
from handlers.task.letterbox import Letterbox


@dataclass(frozen=True)
class DetectorInput:
    """A list of float images (torchvision), a letterboxed batch and its letterboxes (YOLO), or an
    SSD's resized batch and its images' sizes (the batched postprocess); `lowest_score_asked`:
    the lowest score threshold of the batch's requests (None: not known, so every candidate the
    model's own threshold lets through is kept)."""

    images: list[torch.Tensor] | torch.Tensor
    letterboxes: list[Letterbox] | None = None
    lowest_score_asked: float | None = None
    original_sizes_hw: list[tuple[int, int]] | None = None     # a resized batch's images' own sizes


def lowest_score_asked(options: Sequence[DetectionOptions] | None) -> float | None:
    """The lowest `score_threshold` among a batch's requests; None for no requests."""
    return min(asked.score_threshold for asked in options) if options else None


def candidate_score_threshold(model_threshold: float, lowest_asked: float | None) -> float:
    """The score threshold a torchvision detector's own postprocess may drop candidates at for a
    batch whose requests each keep scores >= their own threshold, the lowest being `lowest_asked`:
    the float32 just below it (the model keeps scores strictly above its threshold), never below
    the model's configured `model_threshold` (the lowest any request can get).

    Every request's answer stays what it is at `model_threshold`: a candidate under every
    request's threshold is never answered, and in the model's per-class top-k, NMS (a box is
    suppressed only by a higher-scoring one) and detections-per-image cap (taken best first) the
    candidates that are answered are decided by higher-scoring candidates only."""
    if lowest_asked is None:
        return model_threshold
    just_below = float(np.nextafter(np.float32(lowest_asked), np.float32(-1.0)))   # host arithmetic
    return max(model_threshold, just_below)


class DetectionTensors(NamedTuple):
    """One image's detections as three aligned tensors (N rows each); see `Detection` for one
    row as the JSON answer shows it."""

    boxes_xyxy: torch.Tensor
    scores: torch.Tensor
    class_indices: torch.Tensor


class Detection(TypedDict):
    """One detection in the JSON answer."""

    label: str
    index: int
    score: float
    box: list[float]


def select_detections(detections: DetectionTensors, options: DetectionOptions) -> DetectionTensors:
    """Keep scores >= threshold and (when given) the requested classes; best first; at most
    `max_detections`. Returns new tensors."""
    keep = detections.scores >= options.score_threshold
    if options.classes is not None:
        wanted = torch.tensor(sorted(options.classes), device=detections.class_indices.device,
                              dtype=detections.class_indices.dtype)
        keep &= torch.isin(detections.class_indices, wanted)
    scores = detections.scores[keep]
    order = torch.argsort(scores, descending=True, stable=True)[: options.max_detections]
    return DetectionTensors(detections.boxes_xyxy[keep][order], scores[order],
                      detections.class_indices[keep][order])


def yolo_candidates(raw: torch.Tensor) -> DetectionTensors:
    """One image's `float[4 + C, N]` YOLO output (cx, cy, w, h in input pixels, then C class
    scores) -> N candidates, each with its best class, boxes xyxy in input pixels, unfiltered."""
    if raw.ndim != 2 or raw.shape[0] < 5:
        raise ValueError(f"expected a YOLO output of shape [4 + C, N], got {tuple(raw.shape)}")
    candidates = raw.transpose(0, 1).float()
    scores, class_indices = candidates[:, 4:].max(dim=1)
    return DetectionTensors(box_convert(candidates[:, :4], in_fmt="cxcywh", out_fmt="xyxy"), scores,
                            class_indices)


def suppress_overlaps(detections: DetectionTensors, iou_threshold: float, max_detections: int,
                      agnostic: bool = False) -> DetectionTensors:
    """Per-class non-maximum suppression (across classes when `agnostic`), then the best
    `max_detections`, best first."""
    if agnostic:
        keep = nms(detections.boxes_xyxy, detections.scores, iou_threshold)[:max_detections]
    else:
        keep = batched_nms(detections.boxes_xyxy, detections.scores, detections.class_indices,
                           iou_threshold)[:max_detections]
    return DetectionTensors(detections.boxes_xyxy[keep], detections.scores[keep],
                            detections.class_indices[keep])


def format_detections(detections: DetectionTensors, labels: Sequence[str]) -> list[Detection]:
    """Detections -> JSON-ready dicts, in the order given (best first)."""
    boxes = detections.boxes_xyxy.float().cpu().tolist()
    scores = detections.scores.float().cpu().tolist()
    indices = detections.class_indices.cpu().tolist()
    return [
        Detection(label=labels[index] if 0 <= index < len(labels) else str(index), index=index,
                  score=score, box=[round(value, 2) for value in box])
        for box, score, index in zip(boxes, scores, indices, strict=True)
    ]
