"""Sampled payloads (handlers/drift/payload_samples.py): opt-in, rate-limited, written off the
request path, bounded on disk, never failing a request."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

from handlers.batch.request_slot import RequestSlot
from handlers.drift.payload_samples import (
    PayloadSample,
    PayloadSampler,
    SampleDirectory,
    SampleSettings,
    TokenBucket,
    sample_settings,
)
from handlers.ground.decoded_requests import DecodedImage, ParsedRequest
from handlers.ground.errors import ClientError
from handlers.ground.limits import SettingsError
from tests.images import encode, textured_rgb
from tests.recording_metrics import RecordingMetrics

IMAGES = [encode(textured_rgb(40, 60, seed), "JPEG") for seed in range(4)]


def answered(index: int) -> RequestSlot:
    slot = RequestSlot(index, {}, lambda name: None)
    slot.parsed = ParsedRequest((IMAGES[index],), None)
    slot.decoded = [DecodedImage(torch.zeros((3, 40, 60), dtype=torch.uint8), None)]
    slot.answer_with([{"label": f"class {index}", "index": index, "probability": 0.5}])
    return slot


def refused(index: int) -> RequestSlot:
    slot = RequestSlot(index, {}, lambda name: None)
    slot.refuse(ClientError(400, "NotAnImage", "text"))
    return slot


def written(sampler: PayloadSampler) -> None:
    sampler.pending.join()


def test_sampling_is_off_unless_the_deployment_turns_it_on():
    assert sample_settings({}) is None
    assert sample_settings({"TSV_SAMPLE_DIR": "/data/samples"}) == SampleSettings(Path("/data/samples"))
    assert sample_settings({"TSV_SAMPLE_DIR": "-", "TSV_SAMPLE_PER_S": "0.5"}) == SampleSettings(None, 0.5)
    for bad in ({"TSV_SAMPLE_PER_S": "often"}, {"TSV_SAMPLE_PER_S": "0"}, {"TSV_SAMPLE_MAX_BYTES": "-1"}):
        with pytest.raises(SettingsError):
            sample_settings({"TSV_SAMPLE_DIR": "/x", **bad})


def test_the_rate_is_a_token_bucket_with_a_burst_of_one_second():
    now = [0.0]
    bucket = TokenBucket(2.0, lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    now[0] = 0.5
    assert [bucket.take(), bucket.take()] == [True, False]
    slow = TokenBucket(0.1, lambda: now[0])
    assert [slow.take(), slow.take()] == [True, False]
    now[0] = 10.5
    assert slow.take()


def test_answered_requests_are_written_with_their_answers_and_refused_ones_are_not(tmp_path):
    sampler = PayloadSampler("m", "2.0", SampleSettings(tmp_path, per_second=100),
                             clock=lambda: 1_700_000_000.25)
    metrics = RecordingMetrics()
    sampler.offer([answered(0), refused(1), answered(2)], metrics)
    written(sampler)
    folder = tmp_path / "m" / "2.0"
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    images = sorted(folder.glob("*.jpg"))
    assert len(records) == 2 and len(images) == 2
    assert {record["sha256"] for record in records} == {hashlib.sha256(IMAGES[i]).hexdigest() for i in (0, 2)}
    assert {image.read_bytes() for image in images} == {IMAGES[0], IMAGES[2]}
    record = next(r for r in records if r["sha256"] == hashlib.sha256(IMAGES[2]).hexdigest())
    assert record == {"model": "m", "version": "2.0", "time": "2023-11-14T22:13:20Z", "format": "jpg",
                      "sha256": record["sha256"],
                      "answer": [{"label": "class 2", "index": 2, "probability": 0.5}]}
    sampler.offer([], metrics)              # outcomes go out with the next batch
    assert [(value, dims["Outcome"]) for name, value, dims in metrics.counters
            if name == "HandlerPayloadSamples"] == [(2, "written")]


def test_beyond_the_rate_samples_are_counted_not_written(tmp_path):
    sampler = PayloadSampler("m", "1", SampleSettings(tmp_path, per_second=1))
    sampler.offer([answered(index) for index in range(4)])
    written(sampler)
    assert sampler.outcomes == {"written": 1, "rate_limited": 3}


def test_the_directory_keeps_the_newest_samples_within_its_bound(tmp_path):
    times = iter(float(t) for t in range(100, 200))
    bound = 2 * (max(len(image) for image in IMAGES) + 400)      # two samples, images and records
    sampler = PayloadSampler("m", "1", SampleSettings(tmp_path, per_second=100, max_bytes=bound),
                             clock=lambda: next(times))
    for index in range(4):
        sampler.offer([answered(index)])
        written(sampler)
    folder = tmp_path / "m" / "1"
    assert sum(path.stat().st_size for path in folder.iterdir()) <= bound
    stems = sorted({path.name.split(".")[0] for path in folder.iterdir()})
    assert [stem[:15] for stem in stems] == ["19700101T000142", "19700101T000143"]   # the newest two
    assert sorted(path.suffix for path in folder.iterdir()) == [".jpg", ".jpg", ".json", ".json"]


def test_a_failed_write_drops_the_sample_and_never_fails_the_request(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the folder should be")
    sampler = PayloadSampler("m", "1", SampleSettings(blocker / "samples", per_second=100))
    sampler.offer([answered(0), answered(1)])        # returns at once, raises nothing
    written(sampler)
    assert sampler.outcomes == {"write_failed": 2}
    assert sampler.writer.is_alive()                  # and keeps going


def test_in_pod_mode_a_sample_is_a_json_line_without_the_image(tmp_path):
    output = io.StringIO()
    sampler = PayloadSampler("m", "1", SampleSettings(None, per_second=100), output=output)
    sampler.offer([answered(3)])
    written(sampler)
    (line,) = output.getvalue().splitlines()
    record = json.loads(line)["payload_sample"]
    assert record["sha256"] == hashlib.sha256(IMAGES[3]).hexdigest() and "image" not in record
    assert record["answer"][0]["label"] == "class 3"


def test_the_bound_holds_for_every_worker_of_a_version_together(tmp_path):
    """Two workers' directories on one folder: each reads what is on disk again every 10 s, so
    the other's samples count and go when they are the oldest."""
    now = [0.0]
    bound = 3 * (max(len(image) for image in IMAGES) + 400)
    first, second = (SampleDirectory(tmp_path, "m", "1", bound, clock=lambda: now[0]) for _ in range(2))
    for index in range(6):
        (first if index % 2 else second).write(PayloadSample("m", "1", 100.0 + index, IMAGES[index % 4], []))
        now[0] += 11            # each write after the other's was scanned
    stems = sorted({path.name.split(".")[0] for path in (tmp_path / "m" / "1").iterdir()})
    assert sum(path.stat().st_size for path in (tmp_path / "m" / "1").iterdir()) <= bound
    assert [stem[:15] for stem in stems] == ["19700101T000143", "19700101T000144", "19700101T000145"]
