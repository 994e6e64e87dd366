"""A batch's record and a worker's runner choice as TorchServe metrics (Prometheus with
metrics_mode=prometheus and model_metrics_auto_detect=true). No-ops without a metrics cache; the
one import from TorchServe happens only when there is one."""

from __future__ import annotations

from typing import Any

from handlers.batch.batch_record import STAGES, BatchRecord
from handlers.batch.metric_dimensions import MetricDimension
from handlers.model.runner_selection import RunnerChoice


def emit_batch_metrics(metrics: Any, record: BatchRecord) -> None:
    """Export a batch's record through TorchServe's metrics cache."""
    if metrics is None:
        return
    from ts.metrics.metric_type_enum import MetricTypes  # TorchServe, only when it gave a cache

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


