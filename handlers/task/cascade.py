"""The confidence cascade's decision, as pure tensor code: which requests of a batch the second
model answers.

The first model's confidence in its answer is its top-1 probability (`probability`) or its top-1
minus top-2 probability (`margin`). A request escalates when it asks `always`, or asks `auto` and
the confidence is below its threshold; `never` keeps the first model's answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from handlers.ground.decoded_requests import DecodedImage
from handlers.ground.escalation import EscalationRule
from handlers.ground.kind_options import CascadeOptions


@dataclass(frozen=True)
class CascadeInput:
    first_batch: torch.Tensor          # the first model's normalized batch
    requests: Sequence[DecodedImage[CascadeOptions]]


@dataclass(frozen=True)
class CascadeOutput:
    """Probabilities `float[B, C]` of the model that answered each request, and which did."""

    probabilities: torch.Tensor
    escalated: list[bool]


def confidences(probabilities: torch.Tensor, rule: EscalationRule) -> torch.Tensor:
    """`float[B, C]` probabilities -> `float[B]`: top-1, or top-1 minus top-2 (`margin`; 1.0
    for a single class)."""
    if rule == "probability" or probabilities.shape[1] < 2:
        return probabilities.max(dim=1).values
    top2 = probabilities.topk(2, dim=1).values
    return top2[:, 0] - top2[:, 1]


def escalated(confidence: torch.Tensor, options: Sequence[CascadeOptions]) -> list[bool]:
    """For each request's options (aligned with `confidence`), whether the second model answers it."""
    values = confidence.float().cpu().tolist()
    return [asked.escalation == "always"
            or (asked.escalation == "auto" and value < asked.threshold)
            for value, asked in zip(values, options, strict=True)]
