from __future__ import annotations

import pytest
import torch

from handlers.task.classification import top_k_classes

LABELS = ["cat", "dog", "cup", "rocket"]


def test_top_k_is_best_first_with_softmax_probabilities():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    answers = top_k_classes(logits, LABELS, 3)
    assert [c["label"] for c in answers[0]] == ["dog", "rocket", "cup"]
    assert [c["index"] for c in answers[0]] == [1, 3, 2]
    expected = torch.softmax(logits[0], 0)[1].item()
    assert answers[0][0]["probability"] == pytest.approx(expected)
    assert answers[1][0]["label"] == "cat"
    probabilities = [c["probability"] for c in answers[0]]
    assert probabilities == sorted(probabilities, reverse=True)


def test_k_is_capped_at_the_number_of_classes():
    answers = top_k_classes(torch.zeros(1, 4), LABELS, 10)
    assert len(answers[0]) == 4
    assert sum(c["probability"] for c in answers[0]) == pytest.approx(1.0)


def test_half_precision_logits_give_float_probabilities():
    answers = top_k_classes(torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float16), LABELS, 1)
    assert isinstance(answers[0][0]["probability"], float)


def test_label_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="5 classes but there are 4 labels"):
        top_k_classes(torch.zeros(1, 5), LABELS, 1)
