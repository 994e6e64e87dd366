"""Drift counting in the worker (handlers/drift/drift_stage.py), with a small fake answer reader."""

from __future__ import annotations

from collections import Counter

import torch

from handlers.batch.request_slot import RequestSlot
from handlers.drift.drift_profile import DriftProfile
from handlers.drift.drift_stage import DriftStage
from handlers.ground.decoded_requests import DecodedImage, ParsedRequest
from handlers.ground.errors import ClientError
from tests.images import encode, textured_rgb
from tests.recording_metrics import RecordingMetrics

PNG_640x480 = encode(textured_rgb(480, 640), "PNG")


def answered(index: int, images: int = 1, several: bool = False, level: int = 200) -> RequestSlot:
    slot = RequestSlot(index, {}, lambda name: None)
    slot.parsed = ParsedRequest((PNG_640x480,) * images, None, several)
    slot.decoded = [DecodedImage(torch.full((3, 48, 64), level, dtype=torch.uint8), None)] * images
    slot.answer_with([f"answer {index}"] * images if several else f"answer {index}")
    return slot


def refused(index: int) -> RequestSlot:
    slot = RequestSlot(index, {}, lambda name: None)
    slot.refuse(ClientError(400, "NotAnImage", "text"))
    return slot


def stage(profile: DriftProfile | None) -> DriftStage:
    return DriftStage("m", "2.0", profile, lambda answer: [("class", "r01")] if answer == "answer 0" else [])


def test_each_answered_image_is_counted_and_a_refused_request_is_not():
    drift = stage(None)
    drift.observe([answered(0), refused(1), answered(2, images=3, several=True)], metrics=None)
    assert drift.counts[("format", "PNG")] == 4 and drift.counts[("width", "512")] == 4
    assert drift.counts[("aspect", "1.25")] == 4 and drift.counts[("brightness", "192")] == 4
    assert drift.counts[("class", "r01")] == 1                      # the answer's own buckets


def test_counts_are_exported_per_batch_with_the_version_only_against_a_profile():
    metrics = RecordingMetrics()
    stage(None).observe([answered(0)], metrics)
    assert metrics.calls == []                     # nothing to compare with: nothing exported
    profile = DriftProfile.from_counts(Counter({("brightness", "192"): 1}), ["brightness", "class"], "test")
    drift = stage(profile)
    drift.export_reference(metrics)
    reference = [(value, dims) for name, value, dims in metrics.calls if name == "HandlerDriftReference"]
    assert len(reference) == 8 + 16 and (1.0, {"ModelName": "m", "Level": "Model", "ModelVersion": "2.0",
                                               "Feature": "brightness", "Bucket": "192"}) in reference
    # every bucket's counter made at 0, so that Prometheus's increase() sees its first counts
    assert sorted((value, dims["Feature"], dims["Bucket"]) for name, value, dims in metrics.counters) == \
        sorted((0, dims["Feature"], dims["Bucket"]) for _, dims in reference)
    metrics.counters.clear()
    drift.observe([answered(0), answered(1, level=10)], metrics)
    observed = {(dims["Feature"], dims["Bucket"]): value for name, value, dims in metrics.counters
                if name == "HandlerDriftObserved" and dims["ModelVersion"] == "2.0"}
    assert observed[("brightness", "192")] == 1 and observed[("brightness", "0")] == 1
    assert observed[("format", "PNG")] == 2 and observed[("class", "r01")] == 1
