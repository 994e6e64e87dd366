"""How far a candidate version's answer is from production's answer to the same request.

Pure functions over the JSON answers the handlers give (a classifier's top-k list, best first,
`[{"label", "index", "probability"}, ...]`; a detector's detections, best first,
`[{"label", "index", "score", "box": [x1, y1, x2, y2]}, ...]`), so that production's answer as
the worker holds it and the candidate's as it came over HTTP are compared alike. Classes are
compared by label, the name a client sees: a candidate whose class list is ordered differently
still agrees where it names the same class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchvision.ops import box_iou

# Two detections are the same object when their classes agree and their boxes overlap this much
# (the PASCAL VOC / COCO AP50 criterion).
MATCH_IOU = 0.5


@dataclass(frozen=True)
class AnswerComparison:
    """`agreement` in [0, 1]: 1.0 when the top-1 classes agree (classifiers), the F1 of matched
    boxes (detectors: 2 x matched / (production's boxes + the candidate's), 1.0 when both found
    nothing). `probability_shift`: |production's top-1 probability - the candidate's probability
    of that class| (classifiers; 1.0 of it when the candidate's top-k lacks the class: bounded
    above by that class's probability, counted as the whole). `flip`: (production's best label,
    the candidate's) when they differ; None when they agree or one side has none."""

    agreement: float
    probability_shift: float | None = None
    flip: tuple[str, str] | None = None


Comparer = Callable[[Any, Any], AnswerComparison]


def best_label_of(answer: Sequence[Any]) -> str | None:
    return str(answer[0]["label"]) if answer else None


def label_flip(production: Sequence[Any], candidate: Sequence[Any]) -> tuple[str, str] | None:
    ours, theirs = best_label_of(production), best_label_of(candidate)
    if ours is None or theirs is None or ours == theirs:
        return None
    return ours, theirs


def compare_classifications(production: Sequence[Any], candidate: Sequence[Any]) -> AnswerComparison:
    """Top-1 agreement and the probability shift of production's top-1 class; ValueError for an
    answer that is not a classifier's."""
    if not production or not candidate:
        raise ValueError("a classifier's answer lists at least one class")
    top = production[0]
    theirs = next((float(score["probability"]) for score in candidate
                   if score["label"] == top["label"]), None)
    shift = abs(float(top["probability"]) - theirs) if theirs is not None else 1.0
    agree = candidate[0]["label"] == top["label"]
    return AnswerComparison(float(agree), shift, label_flip(production, candidate))


def matched_boxes(production: Sequence[Any], candidate: Sequence[Any], min_iou: float) -> int:
    """Greedy one-to-one matching, production's detections best first: each takes the candidate
    detection of the same class with the highest IoU >= `min_iou` not taken yet."""
    if not production or not candidate:
        return 0
    ious = box_iou(torch.tensor([d["box"] for d in production], dtype=torch.float64),
                   torch.tensor([d["box"] for d in candidate], dtype=torch.float64))
    same_class = torch.tensor([[p["label"] == c["label"] for c in candidate] for p in production])
    ious = torch.where(same_class & (ious >= min_iou), ious, torch.full_like(ious, -1.0))
    matched = 0
    for row in ious:
        best = int(torch.argmax(row))
        if row[best] >= 0:
            matched += 1
            ious[:, best] = -1.0
    return matched


def compare_detections(production: Sequence[Any], candidate: Sequence[Any],
                       min_iou: float = MATCH_IOU) -> AnswerComparison:
    """Matched-box F1 (see AnswerComparison) and the best detection's label flip."""
    if not production and not candidate:
        return AnswerComparison(1.0)
    matched = matched_boxes(production, candidate, min_iou)
    return AnswerComparison(2 * matched / (len(production) + len(candidate)),
                            flip=label_flip(production, candidate))
