"""The Ultralytics path's pure parts against Ultralytics' own functions (the `ultralytics` package,
a test dependency): its NMS (handlers/task/ultralytics_nms.py) against `non_max_suppression` on
random YOLO outputs under every option, and its letterbox geometry and box mapping
(handlers/task/letterbox.py) against `LetterBox` and `scale_boxes`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from handlers.ground.kind_options import DetectionOptions
from handlers.task.letterbox import boxes_to_original, ultralytics_geometry, ultralytics_letterbox_batch
from handlers.task.ultralytics_nms import ultralytics_detections, ultralytics_end_to_end_detections
from tests.ultralytics_models import offline_ultralytics


@pytest.fixture(scope="module")
def ultralytics() -> Any:
    """Ultralytics' modules, imported here (about 2 s) rather than when the suite is collected."""
    with offline_ultralytics():
        from ultralytics.data.augment import LetterBox
        from ultralytics.utils import nms, ops
    return type("Ultralytics", (), {"LetterBox": LetterBox, "nms": nms, "ops": ops})


def yolo_output(seed: int, classes: int = 80, boxes: int = 8400) -> torch.Tensor:
    """`float[4 + C, N]` as a detection head answers: clustered boxes (so that NMS has work) in a
    640 input, sigmoid-like scores of which a few hundred pass 0.25."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.rand(40, 2, generator=generator) * 640
    which = torch.randint(0, 40, (boxes,), generator=generator)
    xy = centres[which] + torch.randn(boxes, 2, generator=generator) * 6
    wh = 20 + torch.rand(boxes, 2, generator=generator) * 120
    scores = torch.sigmoid(torch.randn(boxes, classes, generator=generator) * 1.5 - 5)
    return torch.cat([xy, wh, scores], dim=1).T.contiguous()


OPTIONS = [
    DetectionOptions(0.25, 0.7, 300),
    DetectionOptions(0.25, 0.7, 300, agnostic_nms=True),
    DetectionOptions(0.1, 0.45, 20),
    DetectionOptions(0.05, 0.5, 1000, classes=frozenset({0, 3, 17})),
    DetectionOptions(0.5, 0.3, 300),
    DetectionOptions(0.99, 0.7, 300),                 # nothing passes
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: f"conf{o.score_threshold}-iou{o.iou_threshold}"
                         f"-max{o.max_detections}{'-agnostic' if o.agnostic_nms else ''}"
                         f"{'-classes' if o.classes else ''}")
def test_the_detections_are_ultralytics_own_in_its_order(ultralytics, seed, options):
    raw = yolo_output(seed)
    expected = ultralytics.nms.non_max_suppression(
        raw[None].clone(), options.score_threshold, options.iou_threshold,
        sorted(options.classes) if options.classes else None, options.agnostic_nms,
        max_det=options.max_detections)[0]
    got = ultralytics_detections(raw, options)
    assert torch.equal(got.boxes_xyxy, expected[:, :4])
    assert torch.equal(got.scores, expected[:, 4])
    assert torch.equal(got.class_indices, expected[:, 5].long())
    if options.score_threshold < 0.9:
        assert len(got.scores) > 0


def test_more_candidates_than_max_nms_keep_the_best(ultralytics):
    raw = yolo_output(4, classes=3, boxes=2000)
    options = DetectionOptions(0.0, 0.7, 300)
    expected = ultralytics.nms.non_max_suppression(raw[None].clone(), 0.0, 0.7, max_det=300, max_nms=500)[0]
    got = ultralytics_detections(raw, options, max_nms=500)
    assert torch.equal(got.scores, expected[:, 4]) and torch.equal(got.boxes_xyxy, expected[:, :4])


SIZES_HW = [(512, 512), (400, 600), (600, 400), (491, 640), (640, 491), (300, 451), (1000, 333),
            (3000, 4000), (1, 800), (427, 640), (481, 641), (33, 35)]


@pytest.mark.parametrize("input_hw", [(640, 640), (480, 640), (320, 256)])
@pytest.mark.parametrize("size_hw", SIZES_HW)
def test_the_geometry_is_letterbox_s_and_boxes_map_back_as_scale_boxes_does(ultralytics, size_hw, input_hw):
    params = ultralytics.LetterBox(input_hw, auto=False, stride=32).get_params(
        {"img": np.zeros((*size_hw, 3), dtype=np.uint8)})
    geometry = ultralytics_geometry(size_hw, input_hw)
    assert geometry.resized_hw == params["new_unpad"][::-1]
    assert (geometry.pad_top, geometry.pad_left) == (params["top"], params["left"])
    assert params["top"] + geometry.resized_hw[0] + params["bottom"] == input_hw[0]
    boxes = torch.tensor([[10.0, 20.0, 300.0, 200.0], [-5.0, 0.0, 700.0, 650.0], [100.5, 33.25, 101.0, 34.0]])
    expected = ultralytics.ops.scale_boxes(input_hw, boxes.clone(), size_hw)
    assert torch.equal(boxes_to_original(boxes, geometry), expected)


def test_the_letterboxed_batch_is_letterbox_s_pixels_in_rgb_over_255(ultralytics):
    rng = np.random.default_rng(0)
    sizes = [(400, 600), (600, 401), (33, 35)]
    images_hwc = [rng.integers(0, 256, (*size, 3), dtype=np.uint8) for size in sizes]
    batch, _ = ultralytics_letterbox_batch([torch.from_numpy(image).permute(2, 0, 1) for image in images_hwc],
                                           (640, 640), 114, torch.device("cpu"))
    for got, image in zip(batch, images_hwc, strict=True):
        expected = ultralytics.LetterBox((640, 640), auto=False, stride=32)(image=image)
        assert torch.equal(got, torch.from_numpy(expected).permute(2, 0, 1).float().div(255))


@pytest.mark.parametrize("options", OPTIONS[:1] + OPTIONS[2:], ids=lambda o: f"conf{o.score_threshold}"
                         f"-max{o.max_detections}{'-classes' if o.classes else ''}")
def test_an_end_to_end_output_is_selected_as_ultralytics_selects_it(ultralytics, options):
    """`[N, 6]` rows (boxes, score, class) as an end-to-end head answers them, best first."""
    generator = torch.Generator().manual_seed(3)
    corners = torch.rand(300, 2, 2, generator=generator) * 640
    boxes = torch.cat([corners.min(dim=1).values, corners.max(dim=1).values], dim=1)
    scores = torch.rand(300, generator=generator).sort(descending=True).values
    classes = torch.randint(0, 80, (300,), generator=generator).float()
    raw = torch.cat([boxes, scores[:, None], classes[:, None]], dim=1)
    expected = ultralytics.nms.non_max_suppression(
        raw[None].clone(), options.score_threshold, options.iou_threshold,
        sorted(options.classes) if options.classes else None, max_det=options.max_detections, end2end=True)[0]
    got = ultralytics_end_to_end_detections(raw, options)
    assert torch.equal(got.boxes_xyxy, expected[:, :4]) and torch.equal(got.scores, expected[:, 4])
    assert torch.equal(got.class_indices, expected[:, 5].long())
