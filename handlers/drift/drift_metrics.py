"""Drift counting's and payload sampling's metrics: the observed buckets and the reference profile
per model version, and the samples' outcomes (through TorchServe's metrics cache; no-ops without
one)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from handlers.batch.metric_dimensions import MetricDimension
from handlers.drift.drift_features import Observation
from handlers.drift.drift_profile import DriftProfile


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
