"""Drift counting in the worker: every computed request's observations, into fixed buckets.

`observe` runs after a batch's answers are computed, in the worker's request thread. For each
answered request that was decoded (not a cache hit, not refused), each image adds its input
buckets (format and stored size from the header, brightness from the decoded image) and the
buckets of its answer (the handler's `answer_observations`). The stage keeps the running total
(`counts`: what the build records as the reference profile) and, when the archive has a
profile, exports the batch's counts as `HandlerDriftObserved{ModelVersion, Feature, Bucket}`
counters; the profile itself is exported once per worker as `HandlerDriftReference` gauges
(handlers.batch_metrics), so that Prometheus compares the two per model and version.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from handlers.batch.batch_record import BatchRecord
from handlers.batch.batch_stage import BatchStage
from handlers.batch.request_slot import RequestSlot, computed_images
from handlers.drift.drift_features import Observation, input_observations, mean_brightnesses
from handlers.drift.drift_metrics import emit_drift_observations, emit_drift_reference
from handlers.drift.drift_profile import DriftProfile
from handlers.request.image_header import read_header

AnswerObservations = Callable[[Any], list[Observation]]


class DriftStage(BatchStage):
    name = "Drift"

    def __init__(self, model_name: str, model_version: str, profile: DriftProfile | None,
                 answer_observations: AnswerObservations) -> None:
        self.model_name, self.model_version = model_name, model_version
        self.profile = profile
        self.answer_observations = answer_observations
        self.counts: Counter[Observation] = Counter()

    def export_reference(self, metrics: Any) -> None:
        """The profile as gauges (at worker start; nothing without a profile)."""
        if self.profile is not None:
            emit_drift_reference(metrics, self.model_name, self.model_version, self.profile)

    def answered(self, slots: Sequence[RequestSlot], computed: Sequence[RequestSlot],
                 record: BatchRecord, metrics: Any) -> None:
        self.observe(computed, metrics)

    def observe(self, slots: Sequence[RequestSlot], metrics: Any) -> None:
        """Count the answered, decoded requests of `slots`; export the batch's counts."""
        batch: Counter[Observation] = Counter()
        computed = list(computed_images(slots))
        brightnesses = mean_brightnesses([item.image for _, _, item, _ in computed])
        for (image_bytes, decoded_by, _, answer), brightness in zip(computed, brightnesses, strict=True):
            header = decoded_by or read_header(image_bytes)
            batch.update(input_observations(header.image_format, header.width, header.height, brightness))
            batch.update(self.answer_observations(answer))
        self.counts.update(batch)
        if self.profile is not None and batch:
            emit_drift_observations(metrics, self.model_name, self.model_version, batch)
