"""Ultralytics' non-maximum suppression for one image, as its `predict` runs it on a detection
export's output (`non_max_suppression` in ultralytics/utils/nms.py, best class per box): the
candidates whose best class score is above the threshold (strictly), the requested classes, the
`max_nms` best of them, then torchvision's NMS over boxes offset by class times `max_wh` (0 for
class-agnostic NMS), the best `max_detections` of what it keeps. An end-to-end export (YOLO26 or
YOLOv10 exported with `end2end=True`, or any detector with `nms=True`) answers its detections
already, `[N, 6]` rows of x1, y1, x2, y2, score, class: the same function keeps those above the
threshold, of the requested classes, the first `max_detections`. Same operations in the same
order, so the same detections, in the same order (tests/unit/test_ultralytics_nms.py holds both
to Ultralytics' function).
"""

from __future__ import annotations

import torch
from torchvision.ops import box_convert, nms

from handlers.ground.kind_options import DetectionOptions
from handlers.task.detection import DetectionTensors

MAX_NMS = 30_000        # Ultralytics' max_nms: candidates into NMS, the best first
MAX_WH = 7680           # its per-class offset of boxes (pixels) for class-aware NMS in one call


def ultralytics_detections(raw: torch.Tensor, options: DetectionOptions,
                           max_nms: int = MAX_NMS) -> DetectionTensors:
    """One image's `float[4 + C, N]` output (cx, cy, w, h in input pixels, then C class scores)
    -> its detections under `options`, boxes xyxy in input pixels, best first."""
    if raw.ndim != 2 or raw.shape[0] < 5:
        raise ValueError(f"expected a YOLO output of shape [4 + C, N], got {tuple(raw.shape)}")
    candidates = raw.transpose(0, 1).float()
    scores, classes = candidates[:, 4:].max(dim=1)
    keep = scores > options.score_threshold
    if options.classes is not None:
        wanted = torch.tensor(sorted(options.classes), device=classes.device, dtype=classes.dtype)
        keep &= torch.isin(classes, wanted)
    boxes = box_convert(candidates[keep, :4], in_fmt="cxcywh", out_fmt="xyxy")
    scores, classes = scores[keep], classes[keep]
    if scores.shape[0] > max_nms:
        best = scores.argsort(descending=True)[:max_nms]
        boxes, scores, classes = boxes[best], scores[best], classes[best]
    offsets = classes.float()[:, None] * (0 if options.agnostic_nms else MAX_WH)
    kept = nms(boxes + offsets, scores, options.iou_threshold)[: options.max_detections]
    return DetectionTensors(boxes[kept], scores[kept], classes[kept])


def ultralytics_end_to_end_detections(raw: torch.Tensor, options: DetectionOptions) -> DetectionTensors:
    """One image's `float[N, 6]` end-to-end output (x1, y1, x2, y2 in input pixels, score, class)
    -> its detections under `options`, in the export's order (best first)."""
    if raw.ndim != 2 or raw.shape[1] < 6:
        raise ValueError(f"expected an end-to-end output of shape [N, 6], got {tuple(raw.shape)}")
    rows = raw.float()
    keep = rows[:, 4] > options.score_threshold
    classes = rows[:, 5].long()
    if options.classes is not None:
        wanted = torch.tensor(sorted(options.classes), device=classes.device, dtype=classes.dtype)
        keep &= torch.isin(classes, wanted)
    chosen = keep.nonzero().view(-1)[: options.max_detections]
    return DetectionTensors(rows[chosen, :4], rows[chosen, 4], classes[chosen])
