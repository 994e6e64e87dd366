"""The detection handler in-process: equivalence with eager torchvision detectors (fixed-seed
weights of each real architecture), and a YOLO-style exported model end to end."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchvision.transforms.v2 import functional as F

from handlers.ground.limits import ImageLimits
from handlers.model.model_loading import built_from_state_dict
from handlers.object_detector import ObjectDetectorHandler
from handlers.request.decode import decode_image_bytes
from tests.archives import archive_context, extract_archive, load_detector, stage_model_dir
from tests.detections import (
    assert_identical_but_tie_order,
    assert_same_detections,
    rows_from_answer,
    rows_from_eager,
)
from tests.images import encode, photo_bytes
from torchserve_vision.archives.build import build_archive, model_source
from torchserve_vision.model_descriptions import parse_description

PHOTOS = ["chelsea.png", "rocket.jpg", "astronaut.png"]  # landscape, landscape, square
SMALL = {"min_size": 160, "max_size": 224}  # the real architectures at a CPU-friendly input size
# Two-stage models: the box head runs on every proposal (1000 per image by default, most of
# the time on a CPU); 100 keep the test quick and the comparison the same on both sides.
FEW_PROPOSALS = {"rpn_pre_nms_top_n_test": 200, "rpn_post_nms_top_n_test": 100}
FAMILIES: dict[str, dict[str, Any]] = {
    "fasterrcnn_resnet50_fpn": {"box_score_thresh": 0.05, **SMALL, **FEW_PROPOSALS},
    "fasterrcnn_resnet50_fpn_v2": {"box_score_thresh": 0.05, **SMALL, **FEW_PROPOSALS},
    "fasterrcnn_mobilenet_v3_large_fpn": {"box_score_thresh": 0.05, **SMALL, **FEW_PROPOSALS},
    "fasterrcnn_mobilenet_v3_large_320_fpn": {"box_score_thresh": 0.05},
    "retinanet_resnet50_fpn": {"score_thresh": 0.05, **SMALL},
    "retinanet_resnet50_fpn_v2": {"score_thresh": 0.05, **SMALL},
    "fcos_resnet50_fpn": {"score_thresh": 0.05, **SMALL},
    "ssd300_vgg16": {"score_thresh": 0.05},
    "ssdlite320_mobilenet_v3_large": {"score_thresh": 0.05},
}
# SSD models resize every image to one fixed size; the others pad a batch to its largest image,
# and that padding reaches into the backbone's features, so their answer for an image depends
# (slightly) on its batch-mates' sizes, in torchvision itself.
FIXED_SIZE_FAMILIES = {"ssd300_vgg16", "ssdlite320_mobilenet_v3_large"}
EVERYTHING = {"score_threshold": 0.0, "max_detections": 300}


def describe(architecture: str, kwargs: dict[str, Any]):
    return parse_description({
        "name": architecture, "task": "detection", "labels": "coco",
        "model": {"source": "torchvision", "architecture": architecture, "weights": "fixed-seed:0",
                  "kwargs": kwargs},
        "handler": {"detection": {"max_detections_cap": 300}},
    })


def ask(handler: ObjectDetectorHandler, images: list[bytes], **options: Any) -> list[Any]:
    rows = [{"body": {"data": base64.b64encode(image).decode(), **options}}
            for image in images]
    context = archive_context(handler.model_dir)
    answers = [json.loads(body) for body in handler.handle(rows, context)]
    assert all(context.status(i) == 200 for i in range(len(rows))), answers
    return answers


def eager_answers(model: nn.Module, images: list[bytes]) -> list[dict[str, torch.Tensor]]:
    tensors = [F.to_dtype(decode_image_bytes(image, ImageLimits()), torch.float32, scale=True)
               for image in images]
    with torch.inference_mode():
        return model(tensors)


def assert_equivalent(served: list[dict], eager: dict[str, torch.Tensor]) -> None:
    assert len(served) > 0
    assert_same_detections(served, rows_from_eager(eager))


@pytest.mark.slow
@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_handler_answers_equal_the_eager_torchvision_model(architecture, tmp_path):
    description = describe(architecture, FAMILIES[architecture])
    # batches of up to three (the photos): the worker warms up at batch 1 and 3, not 1 and 4
    handler = load_detector(stage_model_dir(description, tmp_path), batch_size=len(PHOTOS))
    # torchvision's architecture with the archive's weights, built without a random initialisation
    eager = built_from_state_dict(model_source(description, 91),
                                  torch.load(handler.model_dir / "model.pt", weights_only=True))
    assert eager is not None
    eager.eval()
    images = [photo_bytes(name) for name in PHOTOS]
    solo_eager = [eager_answers(eager, [image])[0] for image in images]
    for image, expected in zip(images, solo_eager, strict=True):
        assert_equivalent(ask(handler, [image], **EVERYTHING)[0], expected)
    batched = ask(handler, images, **EVERYTHING)  # three sizes, one forward pass
    batch_eager = solo_eager if architecture in FIXED_SIZE_FAMILIES else eager_answers(eager, images)
    for served, expected in zip(batched, batch_eager, strict=True):
        assert_equivalent(served, expected)
    top_scores = {tuple(round(d["score"], 4) for d in answer[:5]) for answer in batched}
    assert len(top_scores) == len(PHOTOS), "the fixed-seed model scores every photo alike"


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["ssdlite320_mobilenet_v3_large",
                                          "fasterrcnn_mobilenet_v3_large_320_fpn"])
def test_a_batch_drops_only_candidates_none_of_its_requests_can_be_answered(architecture, tmp_path):
    handler = load_detector(stage_model_dir(describe(architecture, FAMILIES[architecture]), tmp_path))
    network = handler.detector.network
    holder: Any = getattr(network, "roi_heads", network)
    configured = holder.score_thresh
    seen: list[float] = []
    network.register_forward_pre_hook(lambda module, args: seen.append(holder.score_thresh))
    images = [photo_bytes(name) for name in PHOTOS]
    everything = [json.loads(body) for body in handler.handle(
        [{"body": {"data": base64.b64encode(image).decode(), **EVERYTHING}} for image in images],
        archive_context(handler.model_dir))]
    assert seen[-1] == configured
    # one threshold exactly at a detection's score (kept: a request keeps scores >= its own)
    asked = [everything[0][4]["score"], everything[1][19]["score"], everything[1][19]["score"]]
    rows = [{"body": {"data": base64.b64encode(image).decode(), "score_threshold": threshold,
                      "max_detections": 300}} for image, threshold in zip(images, asked, strict=True)]
    answers = [json.loads(body) for body in handler.handle(rows, archive_context(handler.model_dir))]
    assert configured < seen[-1] < min(asked)
    assert holder.score_thresh == configured
    for answer, all_found, threshold in zip(answers, everything, asked, strict=True):
        assert answer == [found for found in all_found if found["score"] >= threshold]
    assert len(answers[0]) == 5 and len(answers[1]) == 20


class BrightBoxDetector(nn.Module):
    """A YOLO-style model ([B, 4 + 2, 1]) that 'detects' the bright region of each input: the box
    around pixels brighter than the letterbox fill, class 0 with score 0.9."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        mask = batch.mean(dim=1) > 0.75
        positions = torch.arange(batch.shape[-1], dtype=batch.dtype)
        rows, cols = mask.any(dim=2), mask.any(dim=1)
        big = torch.full_like(rows, 1e6, dtype=batch.dtype)
        y1 = torch.where(rows, positions, big).amin(dim=1)
        y2 = torch.where(rows, positions, -big).amax(dim=1) + 1
        x1 = torch.where(cols, positions, big).amin(dim=1)
        x2 = torch.where(cols, positions, -big).amax(dim=1) + 1
        scores = torch.stack([torch.full_like(x1, 0.9), torch.full_like(x1, 0.05)], dim=1)
        boxes = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=1)
        return torch.cat([boxes, scores], dim=1).unsqueeze(-1)


def picture_with_bright_box(size_hw: tuple[int, int], box_xyxy: tuple[int, int, int, int]) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size_hw[1], size_hw[0]), (20, 30, 40))
    ImageDraw.Draw(image).rectangle([box_xyxy[0], box_xyxy[1], box_xyxy[2] - 1, box_xyxy[3] - 1],
                                    fill=(250, 250, 250))
    return encode(image, "PNG")


@pytest.fixture(scope="module")
def yolo_handler(tmp_path_factory) -> ObjectDetectorHandler:
    work: Path = tmp_path_factory.mktemp("yolo")
    batch = torch.export.Dim("batch", min=1, max=32)
    program = torch.export.export(BrightBoxDetector(), (torch.zeros(2, 3, 320, 320),),
                                  dynamic_shapes=({0: batch},))
    torch.export.save(program, work / "bright.pt2")
    (work / "labels.txt").write_text("bright\ndark\n")
    description = parse_description({
        "name": "bright", "task": "detection", "labels": str(work / "labels.txt"),
        "model": {"source": "export", "weights": str(work / "bright.pt2")},
        "handler": {"detection": {"output": "yolo", "input_size": 320, "score_threshold": 0.5}},
    })
    mar = build_archive(description, work / "store")
    return load_detector(extract_archive(mar, work / "extracted"))


@pytest.mark.slow
def test_yolo_boxes_land_on_the_objects_in_original_pixels_for_every_orientation(yolo_handler):
    cases = [((480, 640), (100, 50, 300, 200)),    # landscape
             ((640, 480), (30, 400, 200, 620)),    # portrait
             ((400, 400), (0, 0, 120, 90)),        # square, box at the corner
             ((300, 900), (850, 100, 900, 300))]   # wide, box at the right edge
    images = [picture_with_bright_box(size, box) for size, box in cases]
    answers = ask(yolo_handler, images)  # one batch of four sizes
    for (size_hw, box), answer in zip(cases, answers, strict=True):
        assert [d["label"] for d in answer] == ["bright"]
        scale = 320 / max(size_hw)
        tolerance = 1 / scale + 0.5  # one model-input pixel, mapped back
        assert answer[0]["box"] == pytest.approx(list(map(float, box)), abs=tolerance)
        assert answer[0]["score"] == pytest.approx(0.9)


@pytest.mark.slow
def test_yolo_requests_in_one_batch_keep_their_own_options(yolo_handler):
    image = picture_with_bright_box((200, 300), (50, 50, 100, 100))
    rows = [{"body": bytearray(image)}, {"body": {"data": base64.b64encode(image).decode(),
                                                  "score_threshold": 0.95}}]
    context = archive_context(yolo_handler.model_dir)
    answers = [json.loads(body) for body in yolo_handler.handle(rows, context)]
    assert len(answers[0]) == 1 and answers[1] == []


@pytest.mark.slow
def test_bad_options_and_bad_images_fail_alone(yolo_handler):
    image = picture_with_bright_box((200, 300), (50, 50, 100, 100))
    rows = [{"body": bytearray(image)}, {"body": {"data": "bm90IGFuIGltYWdl"}},
            {"body": bytearray(image)}]
    context = archive_context(yolo_handler.model_dir, request_headers=[{}, {}, {"X-Classes": "nope"}])
    answers = [json.loads(body) for body in yolo_handler.handle(rows, context)]
    assert [context.status(i) for i in range(3)] == [200, 400, 400]
    assert answers[0][0]["label"] == "bright"
    assert answers[2]["type"] == "InvalidParameter"


def with_postprocess(model_dir: Path, target: Path, postprocess: str) -> Path:
    """A copy of a staged model directory whose archive YAML sets `detection.postprocess`."""
    import shutil

    import yaml

    shutil.copytree(model_dir, target)
    config_path = target / "model-config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["handler"].setdefault("detection", {})["postprocess"] = postprocess
    config_path.write_text(yaml.safe_dump(config))
    return target


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["ssdlite320_mobilenet_v3_large"])
def test_the_batched_postprocess_answers_as_torchvisions_own(architecture, tmp_path):
    """handlers.task.ssd_postprocess (a GPU worker's choice) forced on the CPU: the same answers as
    the network's own postprocess (detections of exactly equal score in either's order), for
    requests with their own thresholds, classes and caps in one batch."""
    (tmp_path / "staged").mkdir()
    staged = stage_model_dir(describe(architecture, FAMILIES[architecture]), tmp_path / "staged")
    per_image = load_detector(with_postprocess(staged, tmp_path / "per-image", "per-image"))
    batched = load_detector(with_postprocess(staged, tmp_path / "batched", "batched"))
    assert (per_image.detector.postprocess, batched.detector.postprocess) == ("per-image", "batched")
    images = [photo_bytes(name) for name in PHOTOS]
    for options in (EVERYTHING, {"score_threshold": 0.3},
                    {"score_threshold": 0.1, "classes": ["person", "kite"], "max_detections": 3}):
        expected = ask(per_image, images, **options)
        for ours, theirs in zip(ask(batched, images, **options), expected, strict=True):
            assert_identical_but_tie_order(rows_from_answer(ours), rows_from_answer(theirs))
    assert any(expected)
