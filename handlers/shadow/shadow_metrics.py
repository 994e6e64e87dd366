"""The shadow stage's metrics: each mirrored request compared, and each copy dropped, by model and
candidate version (through TorchServe's metrics cache; no-ops without one)."""

from __future__ import annotations

from typing import Any

from handlers.batch.metric_dimensions import MetricDimension, metric_label_value


def shadow_dimensions(model: str, candidate: str, *extra: MetricDimension) -> list[MetricDimension]:
    """Named in full (not left to TorchServe's defaults, which depend on the batch in flight):
    these metrics are emitted from the shadow sender's thread."""
    return [MetricDimension("ModelName", model), MetricDimension("Level", "Model"),
            MetricDimension("Candidate", candidate), *extra]


def emit_shadow_comparison(metrics: Any, model: str, candidate: str, comparison: Any,
                           candidate_ms: float) -> None:
    """One mirrored request compared (a handlers.shadow.answer_comparison.AnswerComparison):
    counters whose ratios `models shadow-report` prints (agreement / compared, ...)."""
    if metrics is None:
        return
    metrics.add_counter("HandlerShadowCompared", 1, dimensions=shadow_dimensions(model, candidate))
    metrics.add_counter("HandlerShadowAgreement", comparison.agreement,
                        dimensions=shadow_dimensions(model, candidate))
    metrics.add_counter("HandlerShadowCandidateMs", round(candidate_ms, 3),
                        dimensions=shadow_dimensions(model, candidate))
    if comparison.probability_shift is not None:
        metrics.add_counter("HandlerShadowProbabilityShift", comparison.probability_shift,
                            dimensions=shadow_dimensions(model, candidate))
    if comparison.flip is not None:
        metrics.add_counter("HandlerShadowFlips", 1, dimensions=shadow_dimensions(
            model, candidate, MetricDimension("From", metric_label_value(comparison.flip[0])),
            MetricDimension("To", metric_label_value(comparison.flip[1]))))


def emit_shadow_dropped(metrics: Any, model: str, candidate: str, reason: str) -> None:
    """A request drawn for the shadow that was not compared, and why (QueueFull, ...)."""
    if metrics is not None:
        metrics.add_counter("HandlerShadowDropped", 1, dimensions=shadow_dimensions(
            model, candidate, MetricDimension("Reason", reason)))
