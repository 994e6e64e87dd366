"""Detect, then classify each box, in-process: a pipeline archive built from the real SSDlite
architecture (fixed-seed weights) and a tiny classifier archive, each answer checked against the
detector archive's own answer plus the classifier on each box's crop computed separately."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from handlers.detect_then_classify import DetectThenClassifyHandler
from handlers.ground.limits import ImageLimits
from handlers.image_classifier import ImageClassifierHandler
from handlers.object_detector import ObjectDetectorHandler
from handlers.request.decode import decode_image_bytes
from handlers.request.detection_options import parse_detection_options
from handlers.task.box_crops import crop_boxes
from handlers.task.classification import top_k_classes
from handlers.task.detection import format_detections
from tests.archives import extract_archive, initialized
from tests.detections import assert_same_detections, rows_from_answer
from tests.images import encode, photo_bytes, textured_rgb
from tests.v2_metadata import assert_outputs_follow_metadata
from torchserve_vision.archives.build import BuildError, build_archive
from torchserve_vision.local_handler import LocalContext, archive_context
from torchserve_vision.model_descriptions import parse_description

pytestmark = pytest.mark.slow   # every test reads the pipeline archives the module builds

PHOTOS = ["chelsea.png", "rocket.jpg", "astronaut.png", "coffee.png"]  # three sizes
LOW: dict[str, Any] = {"score_threshold": 0.05}  # fixed-seed scores are low; enough boxes to classify


def pipeline_description(**handler: Any):
    return parse_description({
        "name": "tiny_pipeline", "version": "1.0", "task": "detect_then_classify",
        "stages": {"detector": "tiny_detector-1.0", "classifier": "tiny_classifier-1.0"},
        "handler": {"boxes": {"max_boxes": 6, "classify_batch_size": 4}, "top_k": 3, **handler}})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("pipeline_store")
    build_archive(parse_description({
        "name": "tiny_detector", "version": "1.0", "task": "detection", "labels": "coco",
        "model": {"source": "torchvision", "architecture": "ssdlite320_mobilenet_v3_large",
                  "weights": "fixed-seed:0", "kwargs": {"score_thresh": 0.001}},
        "handler": {"detection": {"score_threshold": 0.3, "max_detections_cap": 300}}}), store,
        reference_requests=0)   # no drift profile: 300 boxes an image are slow to count
    build_archive(parse_description({
        "name": "tiny_classifier", "version": "1.0", "labels": "imagenet",
        "model": {"source": "timm", "architecture": "test_efficientnet", "weights": "fixed-seed:1"},
        "handler": {"preprocess": {"resize_size": 72, "input_size": 64}}}), store)
    build_archive(pipeline_description(), store)
    return store


@pytest.fixture(scope="module")
def handlers(store: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("pipeline_work")

    def load(handler, archive: str, batch_size: int = 4):
        return initialized(handler, extract_archive(store / archive, work / archive), batch_size)

    return (load(DetectThenClassifyHandler(), "tiny_pipeline-1.0.mar"),
            load(ObjectDetectorHandler(), "tiny_detector-1.0.mar"),
            load(ImageClassifierHandler(), "tiny_classifier-1.0.mar"))


def run(handler, bodies: list[Any]) -> tuple[list[Any], LocalContext]:
    rows = [{"body": body} for body in bodies]
    context = archive_context(handler.model_dir, request_headers=[{} for _ in rows])
    return [json.loads(answer) for answer in handler.handle(rows, context)], context


def as_json(image: bytes, **fields: Any) -> dict[str, Any]:
    return {"data": base64.b64encode(image).decode(), **fields}


def expected_answer(detector, classifier, image: bytes, max_boxes: int = 6, top_k: int = 3,
                    classes: set[int] | None = None, **options: Any) -> list[dict[str, Any]]:
    """The detector archive's model on this image alone, then each chosen box (exact, before the
    answer rounds it) cropped from this image alone and classified alone by the classifier
    archive's model."""
    model = detector.detector
    asked = parse_detection_options({"body": options}, lambda _: None, detector.settings.defaults,
                                    detector.labels, detector.settings.max_detections_cap)
    decoded = decode_image_bytes(image, ImageLimits(), torch.device("cpu"))
    with torch.inference_mode():
        model_input = model.model_input([decoded])
        (found,) = model.detections(model.forward(model_input), model_input, [decoded], [asked])
    answer: list[dict[str, Any]] = [{**d, "classification": None}
                                    for d in format_detections(found, detector.labels)]
    chosen = [row for row, d in enumerate(answer) if classes is None or d["index"] in classes]
    for row in chosen[:max_boxes]:
        crop = crop_boxes([decoded], [found.boxes_xyxy[row:row + 1]], classifier.settings.input_size)
        with torch.inference_mode():
            logits = classifier.classifier.logits(classifier.classifier.crops_input(crop))
        answer[row]["classification"] = top_k_classes(logits, classifier.labels, top_k)[0]
    return answer


def assert_same(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """The same detections (near-equal scores may trade places, as in the detector's own tests),
    and each box the same classification or none."""
    assert_same_detections(got, rows_from_answer(expected))
    for detection in got:
        (wanted,) = [e["classification"] for e in expected if e["index"] == detection["index"]
                     and max(abs(a - b) for a, b in zip(e["box"], detection["box"], strict=True)) < 0.05]
        found = detection["classification"]
        if wanted is None:
            assert found is None
            continue
        assert [c["index"] for c in found] == [c["index"] for c in wanted]
        assert [c["probability"] for c in found] == pytest.approx(
            [c["probability"] for c in wanted], abs=1e-4)


def test_each_answer_is_the_detectors_plus_the_classifier_on_each_box_alone_in_a_mixed_batch(handlers):
    pipeline, detector, classifier = handlers
    images = [photo_bytes(name) for name in PHOTOS]
    answers, _ = run(pipeline, [as_json(image, **LOW) for image in images])
    classified = 0
    for image, answer in zip(images, answers, strict=True):
        assert_same(answer, expected_answer(detector, classifier, image, **LOW))
        classified += sum(d["classification"] is not None for d in answer)
    assert classified > 8  # more boxes than one classifier chunk (4): chunking is exercised
    assert len({d["classification"][0]["index"] for a in answers for d in a if d["classification"]}) > 1


def test_boxes_at_the_image_border_are_classified_as_alone(handlers):
    pipeline, detector, classifier = handlers
    answers, _ = run(pipeline, [as_json(photo_bytes("rocket.jpg"), score_threshold=0.0,
                                        max_detections=300, max_boxes=100)])
    height, width = 427, 640
    border = [d for d in answers[0] if d["classification"] is not None
              and (min(d["box"][:2]) == 0 or d["box"][2] == width or d["box"][3] == height)]
    assert border, "no box touches the border"
    assert_same(answers[0], expected_answer(detector, classifier, photo_bytes("rocket.jpg"),
                                            max_boxes=100, score_threshold=0.0, max_detections=300))


def test_max_boxes_classes_and_top_k_per_request_and_zero_boxes(handlers):
    pipeline, detector, classifier = handlers
    image = photo_bytes("astronaut.png")
    (everything,), _ = run(pipeline, [as_json(image, **LOW)])
    wanted = {everything[1]["index"]}
    bodies = [as_json(image, max_boxes=2, top_k=1, **LOW),
              as_json(image, classify_classes=[everything[1]["label"]], **LOW),
              as_json(encode(textured_rgb(120, 160), "PNG"), score_threshold=1.0)]
    answers, context = run(pipeline, bodies)
    assert [context.status(i) for i in range(3)] == [200, 200, 200]
    assert_same(answers[0], expected_answer(detector, classifier, image, max_boxes=2, top_k=1, **LOW))
    assert_same(answers[1], expected_answer(detector, classifier, image, classes=wanted, **LOW))
    assert answers[2] == []


@pytest.mark.parametrize("option", [{"max_boxes": 0}, {"max_boxes": 101},
                                    {"classify_classes": ["unicorn"]}, {"top_k": "many"}])
def test_a_bad_option_or_upload_fails_only_itself(handlers, option):
    pipeline, detector, classifier = handlers
    image = photo_bytes("chelsea.png")
    answers, context = run(pipeline, [as_json(image, **LOW), as_json(image, **option),
                                      bytearray(b"junk")])
    assert [context.status(i) for i in range(3)] == [200, 400, 400]
    assert_same(answers[0], expected_answer(detector, classifier, image, **LOW))


def test_the_stages_must_be_a_detector_and_a_classifier(store, tmp_path):
    for name in ("tiny_detector-1.0.mar", "tiny_classifier-1.0.mar"):
        (tmp_path / name).write_bytes((store / name).read_bytes())
    swapped = parse_description({
        "name": "swapped", "task": "detect_then_classify",
        "stages": {"detector": "tiny_classifier-1.0", "classifier": "tiny_detector-1.0"}})
    with pytest.raises(BuildError, match="must be a detection archive"):
        build_archive(swapped, tmp_path)


@pytest.mark.parametrize("which", ["pipeline", "detector"])
def test_the_v2_metadata_declares_what_the_detectors_answer_for_images_with_more_and_fewer_boxes(
        handlers, which):
    handler = handlers[0] if which == "pipeline" else handlers[1]
    data = [base64.b64encode(photo_bytes(name)).decode() for name in PHOTOS[:3]]
    body = {"inputs": [{"name": "image", "shape": [3], "datatype": "BYTES", "data": data}]}
    (answer,), context = run(handler, [body])
    assert context.status(0) == 200
    names = {output["name"] for output in answer["outputs"]}
    assert "boxes_shapes" in names          # the photos have different numbers of boxes
    assert_outputs_follow_metadata(answer["outputs"], handler.describe()["v2"], images=3)
