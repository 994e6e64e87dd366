"""YOLO-style decoding with synthetic raw outputs whose right answer is known."""

from __future__ import annotations

import pytest
import torch

from handlers.ground.kind_options import DetectionOptions
from handlers.model.detector_formats import candidates_from, yolo_detections
from handlers.task.detection import (
    DetectionTensors,
    candidate_score_threshold,
    format_detections,
    lowest_score_asked,
    select_detections,
)
from handlers.task.letterbox import boxes_to_letterbox, boxes_to_original, letterbox_geometry

OPTIONS = DetectionOptions(score_threshold=0.25, iou_threshold=0.5, max_detections=100)
NUM_CLASSES = 3


def raw_output(boxes_xyxy: torch.Tensor, classes: list[int], scores: list[float],
               noise_candidates: int = 50) -> torch.Tensor:
    """`[4 + C, N]`: the given boxes as (cx, cy, w, h) with one class score each, plus low-score
    background candidates, in shuffled order."""
    top_left, bottom_right = boxes_xyxy[:, :2], boxes_xyxy[:, 2:]
    cxcywh = torch.cat([(top_left + bottom_right) / 2, bottom_right - top_left], 1)
    class_scores = torch.zeros(len(classes), NUM_CLASSES)
    class_scores[torch.arange(len(classes)), torch.tensor(classes)] = torch.tensor(scores)
    generator = torch.Generator().manual_seed(1)
    noise = torch.cat([torch.rand(noise_candidates, 2, generator=generator) * 600 + 20,
                       torch.full((noise_candidates, 2), 10.0),
                       torch.rand(noise_candidates, NUM_CLASSES, generator=generator) * 0.2], 1)
    candidates = torch.cat([torch.cat([cxcywh, class_scores], 1), noise])
    order = torch.randperm(len(candidates), generator=generator)
    return candidates[order].transpose(0, 1).contiguous()


@pytest.mark.parametrize("size_hw", [(480, 640), (640, 480), (500, 500)])
def test_known_boxes_come_back_exactly_in_original_pixels(size_hw):
    height, width = size_hw
    truth = torch.tensor([[10.0, 20.0, 110.0, 220.0],
                          [200.0, 150.0, 300.0, 260.0],
                          [width - 90.0, height - 80.0, width - 10.0, height - 5.0]])
    geometry = letterbox_geometry(size_hw, 640)
    in_input = boxes_to_letterbox(truth, geometry)
    duplicate = in_input[0] + torch.tensor([2.0, 2.0, 2.0, 2.0])  # same class, overlapping, weaker
    other_class_overlap = in_input[1] + 1.0                        # overlapping but another class
    below_threshold = in_input[2] - 30.0
    raw = raw_output(torch.stack([*in_input, duplicate, other_class_overlap, below_threshold]),
                     classes=[0, 1, 2, 0, 2, 1], scores=[0.9, 0.8, 0.7, 0.6, 0.5, 0.2])
    boxes, scores, classes = yolo_detections(raw, OPTIONS)
    original = boxes_to_original(boxes, geometry)
    assert classes.tolist() == [0, 1, 2, 2]
    assert scores.tolist() == pytest.approx([0.9, 0.8, 0.7, 0.5])
    expected = torch.stack([truth[0], truth[1], truth[2],
                            boxes_to_original(other_class_overlap[None], geometry)[0]])
    assert torch.allclose(original, expected, atol=1e-3)


def test_nms_threshold_controls_what_overlaps_survive():
    box = torch.tensor([[100.0, 100.0, 200.0, 200.0], [110.0, 100.0, 210.0, 200.0]])  # IoU 0.82
    raw = raw_output(box, classes=[0, 0], scores=[0.9, 0.8], noise_candidates=0)
    assert len(yolo_detections(raw, OPTIONS).scores) == 1
    loose = DetectionOptions(0.25, iou_threshold=0.9, max_detections=100)
    assert len(yolo_detections(raw, loose).scores) == 2


def test_class_filter_and_cap_apply():
    boxes = torch.tensor([[0.0, 0, 10, 10], [20.0, 0, 30, 10], [40.0, 0, 50, 10]])
    raw = raw_output(boxes, classes=[0, 1, 2], scores=[0.9, 0.8, 0.7], noise_candidates=0)
    only_two = DetectionOptions(0.25, 0.5, 100, classes=frozenset({2}))
    assert yolo_detections(raw, only_two).class_indices.tolist() == [2]
    capped = DetectionOptions(0.25, 0.5, max_detections=2)
    assert yolo_detections(raw, capped).scores.tolist() == pytest.approx([0.9, 0.8])


def test_nothing_above_threshold_is_an_empty_answer():
    raw = raw_output(torch.tensor([[0.0, 0, 10, 10]]), classes=[0], scores=[0.1])
    found = yolo_detections(raw, OPTIONS)
    assert format_detections(found, ["a", "b", "c"]) == []


def test_a_malformed_output_shape_is_refused():
    with pytest.raises(ValueError, match=r"\[4 \+ C, N\]"):
        yolo_detections(torch.zeros(4, 10), OPTIONS)


def test_select_sorts_by_score_and_keeps_inputs_unchanged():
    detections = DetectionTensors(torch.arange(12.0).view(3, 4), torch.tensor([0.3, 0.9, 0.5]),
                            torch.tensor([1, 2, 1]))
    chosen = select_detections(detections, DetectionOptions(0.4, 0.5, 10))
    assert chosen.scores.tolist() == pytest.approx([0.9, 0.5])
    assert chosen.boxes_xyxy.tolist() == [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    assert detections.scores.tolist() == pytest.approx([0.3, 0.9, 0.5])


def test_format_gives_label_index_score_and_box():
    detections = DetectionTensors(torch.tensor([[1.234, 2.0, 3.0, 4.0]]), torch.tensor([0.5]),
                                  torch.tensor([1]))
    assert format_detections(detections, ["cat", "dog"]) == [
        {"label": "dog", "index": 1, "score": 0.5, "box": [1.23, 2.0, 3.0, 4.0]}]


def float32_below(value: float) -> float:
    return torch.nextafter(torch.tensor(value), torch.tensor(-1.0)).item()


def test_the_candidate_threshold_sits_just_below_the_lowest_asked_and_never_below_the_models():
    asked = [DetectionOptions(0.5, 0.5, 10), DetectionOptions(0.3, 0.5, 10)]
    assert lowest_score_asked(asked) == 0.3 and lowest_score_asked([]) is None
    threshold = candidate_score_threshold(0.001, 0.3)
    assert threshold < 0.3 and threshold == float32_below(0.3)
    score_at_threshold = torch.tensor([0.3])        # a request keeps scores equal to its threshold
    assert bool(score_at_threshold > threshold)     # and the model keeps scores above its own
    assert candidate_score_threshold(0.001, 0.0) == 0.001
    assert candidate_score_threshold(0.05, None) == 0.05


class Postprocess:
    def __init__(self, score_thresh: float) -> None:
        self.score_thresh = score_thresh


class TwoStage:                               # the R-CNNs keep the threshold on their roi_heads
    def __init__(self) -> None:
        self.roi_heads = Postprocess(0.05)


@pytest.mark.parametrize("network, holder_of", [
    (Postprocess(0.001), lambda network: network),
    (TwoStage(), lambda network: network.roi_heads),
])
def test_a_batch_raises_the_models_threshold_for_its_forward_pass_only(network, holder_of):
    configured = holder_of(network).score_thresh
    with candidates_from(network, 0.4):
        assert holder_of(network).score_thresh == float32_below(0.4)
    assert holder_of(network).score_thresh == configured
    with pytest.raises(RuntimeError), candidates_from(network, 0.4):
        raise RuntimeError("the forward pass failed")
    assert holder_of(network).score_thresh == configured
    with candidates_from(object(), 0.4):      # a network without the setting runs as it is
        pass
