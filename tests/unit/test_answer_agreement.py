"""The one criterion for "the same answer" (handlers/model/answer_agreement.py), used by the worker's
load-time check of compiled packages and by the tests."""

from __future__ import annotations

import math

import pytest
import torch

from handlers.model.answer_agreement import (
    DEVICE_BOUND,
    PROBABILITY_BOUNDS,
    answer_disagreement,
    cross_device_bound,
    probability_bound,
    ranking_disagreement,
    top_classes,
)

BF16 = PROBABILITY_BOUNDS["bf16"]


def test_bounds_follow_the_precisions_significant_bits():
    assert (PROBABILITY_BOUNDS["fp32"] < PROBABILITY_BOUNDS["fp16"] < PROBABILITY_BOUNDS["bf16"]
            < PROBABILITY_BOUNDS["int8"])
    assert probability_bound("fp32", "bf16") == BF16
    assert probability_bound("fp32") == PROBABILITY_BOUNDS["fp32"]


def test_a_gpu_answer_may_move_by_the_device_bound_plus_its_precisions_rounding():
    assert cross_device_bound("fp32") == DEVICE_BOUND == 0.02
    assert DEVICE_BOUND >= 2 * 0.0060               # twice the worst on an H200 (docs/precision.md)
    for precision in ("fp32", "tf32", "fp16", "bf16"):   # the CPU's pixels: the rounding alone
        assert cross_device_bound(precision, device_decoder=False) == PROBABILITY_BOUNDS[precision]
    assert cross_device_bound("tf32") == cross_device_bound("fp16") == DEVICE_BOUND + 0.02
    assert cross_device_bound("bf16") == DEVICE_BOUND + BF16
    assert PROBABILITY_BOUNDS["tf32"] == PROBABILITY_BOUNDS["fp16"]


def test_an_answer_agrees_with_itself_and_within_the_bound():
    answer = [(1, 0.6), (2, 0.2), (3, 0.1)]
    assert answer_disagreement(answer, answer, 1e-4) is None
    moved = [(1, 0.6 - BF16 * 0.9), (2, 0.2 + BF16 * 0.9), (3, 0.1)]
    assert answer_disagreement(moved, answer, BF16) is None


def test_a_probability_moved_beyond_the_bound_disagrees():
    reason = answer_disagreement([(1, 0.5), (2, 0.2)], [(1, 0.5 + 1.5 * BF16), (2, 0.2)], BF16)
    assert reason is not None and "class 1" in reason


def test_a_clear_answer_must_keep_its_best_class_and_an_unclear_one_may_swap():
    clear = [(1, 0.9), (2, 0.05)]
    reason = answer_disagreement([(2, 0.9), (1, 0.05)], clear, BF16)
    assert reason is not None and "best classes are [2], expected [1]" in reason
    assert ranking_disagreement([(2, 0.5), (1, 0.45)], clear, BF16) is not None
    unclear = [(1, 0.40), (2, 0.39), (3, 0.1)]
    assert answer_disagreement([(2, 0.40), (1, 0.39), (3, 0.1)], unclear, 0.02) is None
    # Deeper ranks too: the two best are clear of the third, in either order.
    assert ranking_disagreement([(2, 0.40), (3, 0.39)], unclear, 0.02) is not None


def test_a_class_listed_by_one_side_only_must_be_near_the_others_last():
    reference = [(1, 0.5), (2, 0.2), (3, 0.1)]
    assert answer_disagreement([(1, 0.5), (2, 0.2), (4, 0.1 + BF16 / 2)], reference, BF16) is None
    reason = answer_disagreement([(1, 0.45), (2, 0.2), (4, 0.1 + 2 * BF16)], reference, BF16)
    assert reason is not None and "class 4" in reason


def test_nan_never_agrees_and_empty_answers_are_an_error():
    assert answer_disagreement([(1, math.nan)], [(1, 0.5)], 1.0) is not None
    with pytest.raises(ValueError):
        answer_disagreement([], [(1, 0.5)], 0.1)


def test_top_classes_are_the_k_best_best_first():
    probabilities = torch.tensor([0.1, 0.6, 0.05, 0.25])
    assert top_classes(probabilities, 2) == [(1, pytest.approx(0.6)), (3, pytest.approx(0.25))]
    assert len(top_classes(probabilities, 10)) == 4
