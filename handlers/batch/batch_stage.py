"""The hooks an optional stage may implement around a batch (BatchedImageHandler.run_batch).

A stage is one class with any of these hooks and one entry in BatchedImageHandler.stages: the
response cache (handlers.cache.cache_stage), drift counting (handlers.drift.drift_stage), payload
samples (handlers.drift.payload_samples) and the shadow (handlers.shadow.shadow_stage). Every hook
call is guarded on its own: one that raises never fails a request; run_batch logs it, counts it
(`Handler<name>StageFailures`) and the batch goes on as if the stage had done nothing there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from handlers.batch.batch_record import BatchRecord
from handlers.batch.request_slot import RequestSlot


class BatchStage:
    """The base does nothing at every hook; a stage overrides those it needs."""

    name = "Stage"    # in its failures' metric and log line

    def parsed(self, slots: Sequence[RequestSlot], record: BatchRecord) -> None:
        """Every request's options and images parsed, nothing decoded: it may answer requests
        (a cache hit), which are then neither decoded nor computed."""

    def decoded(self, slots: Sequence[RequestSlot], record: BatchRecord) -> None:
        """The open requests decoded, nothing computed: it may still answer requests."""

    def answered(self, slots: Sequence[RequestSlot], computed: Sequence[RequestSlot],
                 record: BatchRecord, metrics: Any) -> None:
        """The batch's answers set (`computed`: the requests computed in this batch), nothing
        sent yet: it may read them, never change them."""
