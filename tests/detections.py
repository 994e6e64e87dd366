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


def in_tie_order(rows: Sequence[Row]) -> list[tuple[float, int, tuple[float, ...]]]:
    """Best first, and among exactly equal scores by class, then box: an order both sides of a
    comparison can agree on where their own order among exact ties is their sort's."""
    return sorted(((-score, index, tuple(box)) for index, score, box in rows))


def assert_identical_but_tie_order(ours: Sequence[Row], theirs: Sequence[Row]) -> None:
    """The same detections bit for bit (labels, scores, boxes), in the same order of scores; among
    detections of exactly equal score, in any order."""
    assert [score for _, score, _ in ours] == [score for _, score, _ in theirs]
    assert in_tie_order(ours) == in_tie_order(theirs)


def assert_detections_within(got: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]],
                             bound: float, threshold: float) -> None:
    """Two answers at `threshold` from computations that differ by rounding of at most `bound`
    (a class score moves by at most `bound`, a box side by at most `bound` of the box's width or
    height): every detection that either answer scores at `threshold + bound` or more has a
    match in the other of the same class, its score within `bound` and each side within `bound`
    of the reference box's size; closer to the threshold a detection may be in one answer only."""
    def within(ours: dict[str, Any], theirs: dict[str, Any], box_size: dict[str, Any]) -> bool:
        left, top, right, bottom = box_size["box"]
        sides = (right - left, bottom - top) * 2
        return (ours["index"] == theirs["index"] and abs(ours["score"] - theirs["score"]) <= bound
                and all(abs(a - b) <= bound * side
                        for a, b, side in zip(ours["box"], theirs["box"], sides, strict=True)))

    for detection in reference:
        if detection["score"] >= threshold + bound:
            assert any(within(other, detection, detection) for other in got), (
                f"nothing within {bound} of {detection} in {got}")
    for detection in got:
        if detection["score"] >= threshold + bound:
            assert any(within(detection, other, other) for other in reference), (
                f"nothing within {bound} of {detection} in {reference}")
