"""Comparing two classifier answers for the same image (lists of {"index", "probability", ...},
best first) with the criterion a worker applies to a compiled package at load
(handlers.model.answer_agreement): probabilities within the bound of the precisions involved, and the
same best classes wherever the expected answer is clear by more than rounding can close."""

from __future__ import annotations

import torch

from handlers.model.answer_agreement import answer_disagreement, probability_bound
from handlers.model.model_loading import cpu_has_native_bf16, effective_precision
from torchserve_vision import paths
from torchserve_vision.model_descriptions import ModelDescription, load_descriptions


def default_classifier() -> ModelDescription:
    """The classifier of config/models.yaml."""
    return next(d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.task == "classification")


def served_classifier_precision() -> str:
    """The precision the default classifier's CPU workers run on this machine."""
    asked = str(default_classifier().handler_options.get("precision", "fp32"))
    return effective_precision(asked, torch.device("cpu"), cpu_has_native_bf16())


def ranked(answer: list[dict]) -> list[tuple[int, float]]:
    return [(candidate["index"], candidate["probability"]) for candidate in answer]


def assert_same_answer(got: list[dict], expected: list[dict], *precisions: str) -> None:
    """`got` is `expected` within the rounding of `precisions` (the loosest; fp32 when none)."""
    bound = probability_bound("fp32", *precisions)
    reason = answer_disagreement(ranked(got), ranked(expected), bound)
    assert reason is None, f"{reason}: got {ranked(got)}, expected {ranked(expected)}"
