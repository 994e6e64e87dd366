"""When the cascade's first answer is not enough (the pipeline settings hold one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EscalationRule = Literal["probability", "margin"]


@dataclass(frozen=True)
class Escalation:
    """When the first stage's answer is not enough: its confidence below `threshold`, where the
    confidence is the top-1 probability (`probability`) or top-1 minus top-2 (`margin`)."""

    rule: EscalationRule
    threshold: float
