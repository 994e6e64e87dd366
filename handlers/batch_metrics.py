"""A batch's record and a worker's runner choice as TorchServe metrics (Prometheus with
metrics_mode=prometheus and model_metrics_auto_detect=true). No-ops without a metrics cache; the
one import from TorchServe happens only when there is one."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from handlers.batch_record import STAGES, BatchRecord
from handlers.drift.drift_features import Observation
from handlers.drift.drift_profile import DriftProfile
from handlers.model.runner_selection import RunnerChoice


@dataclass(frozen=True)
class MetricDimension:
    """A metric dimension, shaped like `ts.metrics.dimension.Dimension` (name, value)."""

    name: str
    value: str


def emit_batch_metrics(metrics: Any, record: BatchRecord) -> None:
    """Export a batch's record through TorchServe's metrics cache."""
    if metrics is None:
        return
    from ts.metrics.metric_type_enum import MetricTypes  # the glue's only TorchServe import

    metrics.add_metric("HandlerBatchSize", record.size, "count", metric_type=MetricTypes.GAUGE)
    metrics.add_metric("HandlerCompiledModel", int(record.runner != "eager"), "count",
                       metric_type=MetricTypes.GAUGE)
    metrics.add_counter("HandlerBatches", 1)
    metrics.add_counter("HandlerRequests", record.size)
    for stage in STAGES:
        metrics.add_metric(f"Handler{stage.capitalize()}Ms", round(record.stage_ms[stage], 3), "ms",
                           metric_type=MetricTypes.GAUGE)
    for reason, count in record.rejected.items():
        metrics.add_counter("HandlerRejectedRequests", count, dimensions=[MetricDimension("Reason", reason)])
    if record.oom_splits:
        metrics.add_counter("HandlerOutOfMemorySplits", record.oom_splits)
    for name, count in record.counters.items():
        metrics.add_counter(f"Handler{name}", count)
    for name, value in record.gauges.items():
        metrics.add_metric(f"Handler{name}", value, "count", metric_type=MetricTypes.GAUGE)


def emit_runner_choice(metrics: Any, network: str, choice: RunnerChoice) -> None:
    """At worker start: which runner serves `network` (HandlerRunnerSelected{Network, Runner},
    one per worker), and each runner refused on the way (HandlerCompiledModelRefusals{Reason,
    Runner})."""
    if metrics is None:
        return
    metrics.add_counter("HandlerRunnerSelected", 1, dimensions=[
        MetricDimension("Network", network), MetricDimension("Runner", choice.runner)])
    for refusal in choice.refusals:
        metrics.add_counter("HandlerCompiledModelRefusals", 1, dimensions=[
            MetricDimension("Reason", refusal.error.kind), MetricDimension("Runner", refusal.runner)])


def emit_queue_full(metrics: Any) -> None:
    """Count a request refused with 503 because the continuous batcher's queue was full."""
    if metrics is not None:
        metrics.add_counter("HandlerRejectedRequests", 1,
                            dimensions=[MetricDimension("Reason", "QueueFull")])


def metric_label_value(text: str) -> str:
    """A class name as a dimension value: TorchServe's metric lines separate dimensions with ',',
    names from values with ':' and sections with '|' and '#', so anything but letters, digits
    and ` _'.-` becomes '_'."""
    return re.sub(r"[^A-Za-z0-9 _'.-]", "_", text)


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


def drift_dimensions(model: str, version: str, feature: str, bucket: str) -> list[MetricDimension]:
    """Named in full: the version is not among TorchServe's default dimensions, and the
    reference is emitted at worker start, outside any request."""
    return [MetricDimension("ModelName", model), MetricDimension("Level", "Model"),
            MetricDimension("ModelVersion", version), MetricDimension("Feature", feature),
            MetricDimension("Bucket", bucket)]


def emit_drift_observations(metrics: Any, model: str, version: str,
                            counts: Mapping[Observation, int]) -> None:
    """A batch's drift observations: HandlerDriftObserved{ModelVersion, Feature, Bucket} += count."""
    if metrics is None:
        return
    for (feature, bucket), count in counts.items():
        metrics.add_counter("HandlerDriftObserved", count,
                            dimensions=drift_dimensions(model, version, feature, bucket))


def emit_drift_reference(metrics: Any, model: str, version: str, profile: DriftProfile) -> None:
    """The version's reference profile: HandlerDriftReference{ModelVersion, Feature, Bucket} =
    share; and every bucket's HandlerDriftObserved counter made at 0, so that Prometheus's
    `increase` counts a bucket's first observations too (it cannot count the jump from no series
    to a first value)."""
    if metrics is None:
        return
    from ts.metrics.metric_type_enum import MetricTypes

    for feature, shares in profile.shares.items():
        for bucket, share in shares.items():
            dimensions = drift_dimensions(model, version, feature, bucket)
            metrics.add_metric("HandlerDriftReference", round(share, 6), "share",
                               dimensions=dimensions, metric_type=MetricTypes.GAUGE)
            metrics.add_counter("HandlerDriftObserved", 0, dimensions=list(dimensions))


def emit_payload_samples(metrics: Any, model: str, version: str, outcomes: Mapping[str, int]) -> None:
    """Sampled payloads by outcome (written, rate_limited, queue_full, write_failed):
    HandlerPayloadSamples{ModelVersion, Outcome} += count."""
    if metrics is None:
        return
    for outcome, count in outcomes.items():
        if count:
            metrics.add_counter("HandlerPayloadSamples", count, dimensions=[
                MetricDimension("ModelName", model), MetricDimension("Level", "Model"),
                MetricDimension("ModelVersion", version), MetricDimension("Outcome", outcome)])
