"""Comparing two classifier answers for the same image (lists of {"index", "probability", ...},
best first): exactly in fp32; within bf16's rounding when either side ran bf16, whose results
also depend on the kernels chosen for each batch size and for compiled vs eager code."""

from __future__ import annotations

import pytest
import torch

from handlers.model_loading import cpu_has_native_bf16, effective_precision
from torchserve_vision import paths
from torchserve_vision.model_descriptions import ModelDescription, load_descriptions

FP32_TOLERANCE = 1e-4  # probability, absolute
BF16_TOLERANCE = 0.03


def default_classifier() -> ModelDescription:
    """The classifier of config/models.yaml."""
    return next(d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.task == "classification")


def served_classifier_precision() -> str:
    """The precision the default classifier's CPU workers run on this machine."""
    asked = str(default_classifier().handler_options.get("precision", "fp32"))
    return effective_precision(asked, torch.device("cpu"), cpu_has_native_bf16())


def assert_same_answer(got: list[dict], expected: list[dict], *precisions: str) -> None:
    """fp32 on every side: the same classes in the same order, probabilities within 1e-4.
    Otherwise: the same best class, `got`'s top 3 among `expected`'s top k, and every class both
    list within 0.03."""
    if all(precision == "fp32" for precision in precisions):
        assert [c["index"] for c in got] == [c["index"] for c in expected]
        tolerance = FP32_TOLERANCE
    else:
        assert got[0]["index"] == expected[0]["index"]
        assert {c["index"] for c in got[:3]} <= {c["index"] for c in expected}
        tolerance = BF16_TOLERANCE
    reference = {c["index"]: c["probability"] for c in expected}
    for candidate in got:
        if candidate["index"] in reference:
            assert candidate["probability"] == pytest.approx(reference[candidate["index"]],
                                                             abs=tolerance)
