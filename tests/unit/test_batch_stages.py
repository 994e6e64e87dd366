"""The optional stages around a batch (handlers.batch.batch_stage): one list in the order their hooks
run, and a stage that fails never fails a request. Before the stages shared one guard, a fault
in the response cache, the payload sampler or the shadow stage failed the whole batch (only drift
counting was guarded); now each is logged, counted (`Handler<name>StageFailures`) and the batch's
answers go out as if the stage had done nothing."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from handlers.batch.batch_stage import BatchStage
from handlers.cache.cache_settings import CacheSettings
from handlers.cache.cache_stage import CacheStage
from handlers.cache.response_cache import ResponseCache
from handlers.drift.payload_samples import PayloadSampler, SampleSettings
from handlers.shadow.shadow_policy import PolicyFile
from handlers.shadow.shadow_stage import ShadowStage
from tests.archives import archive_context
from tests.images import photo_bytes

PHOTOS = ["coffee.png", "chelsea.png", "astronaut.png"]


def served(handler, caplog) -> tuple[list, list[int], dict]:
    """The photos answered in one batch: answers, statuses and the batch line's counters."""
    context = archive_context(handler.model_dir)
    with caplog.at_level(logging.INFO, logger="handlers.serving"):
        bodies = handler.handle([{"body": bytearray(photo_bytes(name))} for name in PHOTOS], context)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch ")]
    caplog.clear()
    return ([json.loads(body) for body in bodies], [context.status(i) for i in range(len(PHOTOS))],
            json.loads(line.removeprefix("batch "))["counters"])


def raising(*args, **kwargs):
    raise RuntimeError("a fault inside the stage")


class FailingPolicy(PolicyFile):
    def current(self):
        raise RuntimeError("a fault inside the stage")


def cache_stage(handler, monkeypatch) -> BatchStage:
    stage = CacheStage(ResponseCache(CacheSettings(enabled=True)), "tiny:1.0:test",
                       handler.near_duplicate_image)
    monkeypatch.setattr(stage.cache, "lookup", raising)
    monkeypatch.setattr(stage.cache, "store", raising)
    return stage


def drift_stage(handler, monkeypatch) -> BatchStage:
    monkeypatch.setattr(handler.drift, "observe", raising)
    return handler.drift


def payload_sampler(handler, monkeypatch) -> BatchStage:
    sampler = PayloadSampler("tiny", "1.0", SampleSettings(None), output=io.StringIO())
    monkeypatch.setattr(sampler.bucket, "take", raising)
    return sampler


def shadow_stage(handler, monkeypatch) -> BatchStage:
    return ShadowStage("tiny", "1.0", FailingPolicy(Path("/nonexistent/policy.json")),
                       handler.compare_answers, handler.replayable)


@pytest.mark.parametrize(("attribute", "make", "name", "hooks"), [
    ("cache", cache_stage, "Cache", 2),              # the lookup after parsing, the store
    ("drift", drift_stage, "Drift", 1),
    ("payload_samples", payload_sampler, "PayloadSamples", 1),
    ("shadow", shadow_stage, "Shadow", 1),
], ids=["cache", "drift", "payload samples", "shadow"])
def test_a_failing_stage_never_fails_a_request(tiny_classifier, monkeypatch, caplog, attribute, make,
                                               name, hooks):
    expected, statuses, counters = served(tiny_classifier, caplog)
    assert statuses == [200] * len(PHOTOS) and f"{name}StageFailures" not in counters
    monkeypatch.setattr(tiny_classifier, attribute, make(tiny_classifier, monkeypatch))
    answers, statuses, counters = served(tiny_classifier, caplog)
    assert statuses == [200] * len(PHOTOS)
    assert answers == expected
    assert counters[f"{name}StageFailures"] == hooks


def test_the_stages_are_one_list_in_the_order_their_hooks_run(tiny_classifier, monkeypatch):
    seen: list[str] = []

    class Recording(BatchStage):
        def __init__(self, name: str) -> None:
            self.name = name

        def parsed(self, slots, record):
            seen.append(f"{self.name}.parsed")

        def decoded(self, slots, record):
            assert all(slot.decoded for slot in slots)
            seen.append(f"{self.name}.decoded")

        def answered(self, slots, computed, record, metrics):
            assert [slot.answer is not None for slot in computed] == [True] * len(PHOTOS)
            seen.append(f"{self.name}.answered")

    for attribute in ("cache", "drift", "payload_samples", "shadow"):
        monkeypatch.setattr(tiny_classifier, attribute, Recording(attribute))
    assert [stage.name for stage in tiny_classifier.stages] == ["cache", "drift", "payload_samples",
                                                                "shadow"]
    archive = archive_context(tiny_classifier.model_dir)
    tiny_classifier.handle([{"body": bytearray(photo_bytes(name))} for name in PHOTOS], archive)
    assert seen == [f"{stage}.{hook}" for hook in ("parsed", "decoded", "answered")
                    for stage in ("cache", "drift", "payload_samples", "shadow")]


def test_each_images_header_is_read_once_per_batch_with_drift_counting_on(tiny_classifier, monkeypatch,
                                                                          caplog):
    from handlers.drift import drift_stage
    from handlers.request import image_header

    reads: list[int] = []
    real = image_header.read_header

    def counted(data):
        reads.append(len(data))
        return real(data)

    monkeypatch.setattr(image_header, "read_header", counted)
    monkeypatch.setattr(drift_stage, "read_header", counted)
    before = sum(tiny_classifier.drift.counts.values())
    served(tiny_classifier, caplog)
    assert len(reads) == len(PHOTOS)                      # by the decode; drift reuses them
    assert sum(tiny_classifier.drift.counts.values()) > before   # and drift did count
