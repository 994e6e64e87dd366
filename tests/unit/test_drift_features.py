"""The fixed drift buckets (handlers/drift/drift_features.py)."""

from __future__ import annotations

import pytest
import torch

from handlers.drift.drift_features import (
    BUCKETS,
    CLASS_RANGES,
    class_range,
    classification_observations,
    confidence_tenth,
    detection_observations,
    input_observations,
    mean_brightness,
    mean_brightnesses,
)


def test_every_value_falls_in_one_of_the_fixed_buckets_at_the_edges_too():
    def bucket(feature: str, width: int, height: int, brightness: float = 0) -> str:
        return dict(input_observations("PNG", width, height, brightness))[feature]

    assert [bucket("width", side, side) for side in (1, 255, 256, 2047, 2048, 9000)] == [
        "0", "0", "256", "1024", "2048", "2048"]
    assert [bucket("aspect", width, 100) for width in (59, 60, 100, 104, 105, 400)] == [
        "0", "0.6", "0.95", "0.95", "1.05", "1.67"]
    assert [bucket("brightness", 10, 10, level) for level in (0, 31.9, 32, 255)] == ["0", "0", "32", "224"]
    assert dict(input_observations("MPO", 10, 10, 0))["format"] == "JPEG"    # a JPEG's variant
    assert [confidence_tenth(p) for p in (0.0, 0.0999, 0.1, 0.95, 1.0)] == ["0.0", "0.0", "0.1", "0.9", "0.9"]
    for observations in (input_observations("GIF", 7, 3000, 99.5), [("confidence", confidence_tenth(0.5))]):
        assert all(bucket in BUCKETS[feature] for feature, bucket in observations)


def test_class_ranges_split_the_class_list_into_equal_contiguous_ranges():
    ranges = [class_range(index, 1000) for index in range(1000)]
    assert ranges == sorted(ranges) and set(ranges) == set(BUCKETS["class"])
    assert {ranges.count(name) for name in set(ranges)} <= {62, 63} and len(set(ranges)) == CLASS_RANGES
    assert class_range(0, 91) == "r00" and class_range(90, 91) == "r15"   # COCO's 91 entries
    with pytest.raises(ValueError, match="outside"):
        class_range(1000, 1000)


def test_brightness_is_the_mean_luma_and_its_cost_does_not_grow_with_the_image():
    grey = torch.full((3, 3000, 4000), 100, dtype=torch.uint8)
    assert mean_brightness(grey) == pytest.approx(100.0)
    half = torch.zeros((3, 64, 64), dtype=torch.uint8)
    half[:, :, 32:] = 255
    assert mean_brightness(half) == pytest.approx(127.5, abs=0.01)
    red = torch.zeros((3, 8, 8), dtype=torch.uint8)
    red[0] = 255
    assert mean_brightness(red) == pytest.approx(0.299 * 255, abs=0.01)


def test_a_batchs_brightnesses_are_each_images_own_in_order_whatever_the_sizes():
    generator = torch.Generator().manual_seed(3)
    shapes = [(3, 720, 720), (3, 100, 57), (3, 720, 720), (3, 31, 2000), (3, 100, 57), (3, 720, 720)]
    images = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator) for shape in shapes]
    images[2] = torch.full((3, 720, 720), 200, dtype=torch.uint8)
    together = mean_brightnesses(images)
    assert together == pytest.approx([mean_brightness(image) for image in images], abs=1e-4)
    assert together[2] == pytest.approx(200.0)
    assert mean_brightnesses([]) == []


def test_a_classifier_answer_gives_its_top_one_class_range_and_confidence():
    answer = [{"label": "tabby", "index": 281, "probability": 0.41},
              {"label": "x", "index": 999, "probability": 0.3}]
    assert classification_observations(answer, 1000) == [("class", "r04"), ("confidence", "0.4")]
    assert classification_observations([], 1000) == []


def test_a_detector_answer_gives_every_box_and_the_image_its_box_count():
    boxes = [{"index": 1, "score": 0.95}, {"index": 90, "score": 0.31}, {"index": 1, "score": 0.5}]
    observations = detection_observations(boxes, 91)
    def buckets(feature: str) -> list[str]:
        return sorted(bucket for name, bucket in observations if name == feature)

    assert (buckets("class"), buckets("confidence"), buckets("boxes")) == (
        ["r00", "r00", "r15"], ["0.3", "0.5", "0.9"], ["3"])
    assert detection_observations([], 91) == [("boxes", "0")]
    assert [b for f, b in detection_observations(boxes * 6, 91) if f == "boxes"] == ["17"]
