"""A GPU worker's batch stops its host a fixed number of times, whatever the number of images: the
code a CUDA worker runs (the device's batched JPEG decode with its chroma interpolation, the
fixed-point resize, the detector's batched transform and postprocess, every stage of the batch:
response cache with near-duplicates, drift counting, payload samples, shadow traffic, metrics)
runs here on CPU tensors under an operation counter (tests/host_round_trips.py), at 1, 8 and 64
same-size 720 x 720 JPEGs in one classifier batch and 1, 4 and 16 in one detector batch (at the
default request threshold, 0.3, and the lowest, 0.001), and each kind of synchronisation must be
as many for the most images as for one.

What remains per batch, and why:
- classifier, every stage on: `copy to host (cpu)` x 3: the top-k probabilities and class
  indices (the answers), and the near-duplicate cache's 32 x 32 luma samples of every image (its
  DCT runs on the host); `copy to host (tolist)` x 1: every image's drift brightness, in one read;
- detector (handlers.task.ssd_postprocess): `copy to host (tolist)` x 2: the longest class's
  candidate count (the IoU matrices' side) with the number of (image, class) pairs that have a
  candidate, read together, and drift brightness; `scalar read` x 1: one convergence check of
  the NMS (it settles within CONVERGENCE_CHECK_EVERY rounds on these photos; a longer chain of
  suppressions adds a check per that many rounds); `tensor from Python data` x 3: each image's
  size and request (threshold, cap, classes), copied to the device in one table, and the two 0.5
  constants torchvision's `BoxCoder.decode_single` makes at each call; `copy to host (cpu)` x 1:
  the answers;
- both: whatever the decoder and the model do inside themselves (nvJPEG's own synchronisation at
  the end of each decode call, once per `limits.max_decode_pixels_per_call` pixels: fixed for a
  batch of a given image size; what `torch.profiler` shows on a GPU, `lab gpu`).
"""

from __future__ import annotations

import base64
import io
import json
from collections import Counter

import pytest

from handlers.cache.cache_settings import CacheSettings
from handlers.cache.cache_stage import CacheStage
from handlers.cache.response_cache import ResponseCache
from handlers.drift.payload_samples import PayloadSampler, SampleSettings
from handlers.request import decode
from handlers.shadow.shadow_policy import PolicyFile, ShadowPolicy
from handlers.shadow.shadow_stage import ShadowStage
from handlers.task import fixed_point_resize
from tests.archives import archive_context
from tests.host_round_trips import counted_round_trips
from tests.recording_metrics import RecordingMetrics
from torchserve_vision.lab.benchmark_images import distinct_jpegs

BATCHES = (1, 8, 64)
DETECTOR_BATCHES = (1, 4, 16)


@pytest.fixture(scope="module")
def classifier_of_64(tmp_path_factory: pytest.TempPathFactory):
    """The tiny classifier (see tests/conftest.py) as built for GPU workers (no reduced-scale
    JPEG decoding on the CPU: every JPEG goes to the device's decoder), its batches up to 64
    images in a CUDA worker's buckets (handlers.model.cuda_batches), every stage on."""
    from tests.archives import load_classifier_dir, stage_model_dir
    from torchserve_vision.model_descriptions import parse_description

    description = parse_description({
        "name": "tiny", "version": "1.0", "labels": "imagenet",
        "model": {"source": "timm", "architecture": "test_efficientnet", "weights": "fixed-seed:1"},
        "handler": {"preprocess": {"resize_size": 72, "input_size": 64}}})
    directory = tmp_path_factory.mktemp("tiny64")
    handler = load_classifier_dir(stage_model_dir(description, directory, "gpu"), batch_size=64,
                                  metrics=RecordingMetrics())
    handler.classifier.run = handler.model = handler.classifier.bucketed(64)   # CUDA's: in buckets
    handler.classifier.run.warm_up()
    handler.cache = CacheStage(ResponseCache(CacheSettings(enabled=True, near_duplicates=True)),
                               "tiny:1.0:test", handler.near_duplicate_image)
    handler.payload_samples = PayloadSampler("tiny", "1.0", SampleSettings(None, per_second=1000.0),
                                             output=io.StringIO())
    policy = directory / "shadow.json"
    policy.write_text(json.dumps(ShadowPolicy("tiny", "1.0", "2.0", 100.0, "http://127.0.0.1:9").to_json()))
    handler.shadow = ShadowStage("tiny", "1.0", PolicyFile(policy), handler.compare_answers,
                                 handler.replayable)
    return handler


def round_trips_of_a_batch(handler, bodies: list[bytes]) -> Counter[str]:
    context = archive_context(handler.model_dir, request_headers=[{} for _ in bodies])
    context.metrics = RecordingMetrics()
    rows = [{"body": bytearray(body)} for body in bodies]
    with counted_round_trips() as counts:
        answers = handler.handle(rows, context)
    assert [context.status(index) for index in range(len(bodies))] == [200] * len(bodies)
    assert len(answers) == len(bodies)
    return counts


def test_a_classifier_batch_synchronises_as_often_for_64_images_as_for_1(classifier_of_64, monkeypatch):
    monkeypatch.setattr(fixed_point_resize, "aten_kernel_serves", lambda device: False)   # CUDA's resize
    monkeypatch.setattr(decode, "decoder_repeats_chroma", lambda *_: True)   # nvJPEG's chroma
    # 256 px, not the lab's 720: the same path (device-decodable 4:2:0, one decode call, the
    # repeated chroma interpolated), an eighth of the pixels to interpolate on the CPU
    jpegs = distinct_jpegs(max(BATCHES) + 1, size=256)
    round_trips_of_a_batch(classifier_of_64, jpegs[-1:])       # first calls: caches of sizes, device tables
    counts = {size: round_trips_of_a_batch(classifier_of_64, jpegs[:size]) for size in BATCHES}
    assert counts[1] == counts[8] == counts[64], counts
    assert counts[1] == Counter({"copy to host (cpu)": 3, "copy to host (tolist)": 1}), counts[1]


@pytest.fixture(scope="module")
def ssdlite_for_gpus(tmp_path_factory: pytest.TempPathFactory):
    """config/models.yaml's SSDlite as built for GPU workers, with the postprocess a GPU worker
    runs (`auto` picks it on CUDA; forced here on the CPU), batches of up to 16."""
    from tests.archives import load_detector, stage_model_dir
    from torchserve_vision import paths
    from torchserve_vision.model_descriptions import load_descriptions

    (description,) = [d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == "ssdlite320"]
    directory = tmp_path_factory.mktemp("ssdlite")
    model_dir = stage_model_dir(description, directory, "gpu")
    config_path = model_dir / "model-config.yaml"
    import yaml

    config = yaml.safe_load(config_path.read_text())
    config["handler"]["detection"]["postprocess"] = "batched"
    config_path.write_text(yaml.safe_dump(config))
    handler = load_detector(model_dir, batch_size=16)
    assert handler.detector.postprocess == "batched"
    return handler


def detections_round_trips(handler, bodies: list[bytes], threshold: float) -> Counter[str]:
    rows = [{"body": {"data": base64.b64encode(body).decode(), "score_threshold": threshold,
                      "max_detections": 300}} for body in bodies]
    context = archive_context(handler.model_dir, request_headers=[{} for _ in bodies])
    context.metrics = RecordingMetrics()
    with counted_round_trips() as counts:
        answers = handler.handle(rows, context)
    assert [context.status(index) for index in range(len(bodies))] == [200] * len(bodies)
    assert sum(len(json.loads(answer)) for answer in answers) > 0
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [0.3, 0.001])
def test_a_detector_batch_synchronises_as_often_for_16_images_as_for_1(ssdlite_for_gpus, monkeypatch,
                                                                       threshold):
    monkeypatch.setattr(decode, "decoder_repeats_chroma", lambda *_: True)   # nvJPEG's chroma
    jpegs = distinct_jpegs(max(DETECTOR_BATCHES) + 1, seed=3)
    detections_round_trips(ssdlite_for_gpus, jpegs[-1:], threshold)     # first calls: the device tables
    counts = {size: detections_round_trips(ssdlite_for_gpus, jpegs[:size], threshold)
              for size in DETECTOR_BATCHES}
    assert counts[1] == counts[4] == counts[16], counts
    assert counts[1] == Counter({"scalar read": 1, "tensor from Python data": 3, "copy to host (cpu)": 1,
                                 "copy to host (tolist)": 2}), counts[1]
