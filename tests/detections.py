"""Comparing detection answers: one-to-one matches within tolerances."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Row = tuple[int, float, list[float]]


def rows_from_answer(answer: Sequence[dict[str, Any]]) -> list[Row]:
    return [(d["index"], d["score"], d["box"]) for d in answer]


def rows_from_eager(output: dict[str, torch.Tensor]) -> list[Row]:
    return list(zip(output["labels"].tolist(), output["scores"].tolist(), output["boxes"].tolist(),
                    strict=True))


def assert_same_detections(served: Sequence[dict[str, Any]], expected: list[Row],
                           box_px: float = 1.0, score: float = 1e-4) -> None:
    """Equal labels, boxes within `box_px`, scores within `score`, matched one to one (near-equal
    scores may trade places), and `served` sorted best first."""
    assert len(served) == len(expected)
    scores = [d["score"] for d in served]
    assert scores == sorted(scores, reverse=True)
    unmatched = list(expected)
    for index, found_score, box in rows_from_answer(served):
        match = next((row for row in unmatched if row[0] == index
                      and abs(row[1] - found_score) <= score
                      and max(abs(a - b) for a, b in zip(row[2], box, strict=True)) <= box_px), None)
        assert match is not None, f"nothing matches class {index} score {found_score} box {box}"
        unmatched.remove(match)
