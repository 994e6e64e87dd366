"""Production's answer against a candidate's (handlers/shadow/answer_comparison.py)."""

from __future__ import annotations

import pytest

from handlers.shadow.answer_comparison import compare_classifications, compare_detections


def scores(*pairs: tuple[int, float]) -> list[dict[str, object]]:
    return [{"label": f"class {index}", "index": index, "probability": p} for index, p in pairs]


def box(index: int, xyxy: list[float], score: float = 0.9) -> dict[str, object]:
    return {"label": f"class {index}", "index": index, "score": score, "box": xyxy}


def test_the_same_top_class_agrees_and_the_shift_is_that_class_probability_difference():
    result = compare_classifications(scores((3, 0.6), (1, 0.3)), scores((3, 0.5), (1, 0.4)))
    assert result.agreement == 1.0 and result.flip is None
    assert result.probability_shift == pytest.approx(0.1)


def test_another_top_class_is_a_flip_from_production_to_the_candidate():
    result = compare_classifications(scores((3, 0.6), (1, 0.3)), scores((1, 0.55), (3, 0.35)))
    assert result.agreement == 0.0 and result.flip == ("class 3", "class 1")
    assert result.probability_shift == pytest.approx(0.25)


def test_a_top_class_missing_from_the_candidates_top_k_counts_as_the_whole_shift():
    result = compare_classifications(scores((3, 0.6)), scores((1, 0.9)))
    assert result.probability_shift == 1.0


def test_an_empty_classification_is_not_an_answer():
    with pytest.raises(ValueError):
        compare_classifications([], scores((1, 0.9)))


def test_identical_detections_agree_fully():
    answer = [box(1, [0, 0, 10, 10]), box(2, [20, 20, 40, 40])]
    assert compare_detections(answer, answer).agreement == 1.0


def test_two_empty_detection_answers_agree():
    assert compare_detections([], []).agreement == 1.0


def test_a_box_matches_only_its_own_class_above_the_iou_threshold():
    production = [box(1, [0, 0, 10, 10]), box(2, [20, 20, 40, 40])]
    shifted = [box(1, [1, 1, 11, 11]),            # IoU 0.68: a match
               box(3, [20, 20, 40, 40])]          # same place, another class: no match
    result = compare_detections(production, shifted)
    assert result.agreement == pytest.approx(2 * 1 / 4)
    far = [box(1, [6, 6, 16, 16])]                # IoU 16/184: no match
    assert compare_detections(production[:1], far).agreement == 0.0


def test_each_candidate_box_matches_at_most_one_production_box():
    production = [box(1, [0, 0, 10, 10]), box(1, [0, 0, 10, 10], 0.8)]
    assert compare_detections(production, [box(1, [0, 0, 10, 10])]).agreement == pytest.approx(2 / 3)


def test_a_detector_flip_is_the_best_detections_label():
    result = compare_detections([box(1, [0, 0, 10, 10])], [box(2, [0, 0, 10, 10])])
    assert result.flip == ("class 1", "class 2") and result.probability_shift is None
