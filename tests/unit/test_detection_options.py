from __future__ import annotations

import pytest

from handlers.ground.errors import ClientError
from handlers.ground.kind_options import DetectionOptions
from handlers.request.detection_options import parse_detection_options

DEFAULTS = DetectionOptions(score_threshold=0.3, iou_threshold=0.45, max_detections=100)
LABELS = ["__background__", "person", "bicycle", "car"]


def parse(row, headers=None):
    headers = headers or {}
    return parse_detection_options(row, headers.get, DEFAULTS, LABELS, max_detections_cap=300)


def test_defaults_when_the_request_says_nothing():
    assert parse({"body": bytearray(b"img")}) == DEFAULTS


def test_json_fields():
    options = parse({"body": {"data": "x", "score_threshold": 0.5, "iou_threshold": 0.6,
                              "max_detections": 7, "classes": ["person", 3]}})
    assert options == DetectionOptions(0.5, 0.6, 7, frozenset({1, 3}))


def test_headers_and_form_fields():
    headers = {"X-Score-Threshold": "0.1", "X-Classes": "Bicycle, car", "X-Max-Detections": "5"}
    assert parse({"body": bytearray(b"img")}, headers) == DetectionOptions(0.1, 0.45, 5, frozenset({2, 3}))
    form = {"data": bytearray(b"img"), "score_threshold": bytearray(b"0.9")}
    assert parse(form).score_threshold == 0.9


def test_the_body_beats_a_header():
    options = parse({"body": {"data": "x", "score_threshold": 0.8}}, {"X-Score-Threshold": "0.1"})
    assert options.score_threshold == 0.8


@pytest.mark.parametrize(("fields", "message"), [
    ({"score_threshold": 1.5}, "score_threshold"),
    ({"score_threshold": "high"}, "score_threshold"),
    ({"score_threshold": float("nan")}, "score_threshold"),
    ({"iou_threshold": 0}, "iou_threshold"),
    ({"max_detections": 0}, "max_detections"),
    ({"max_detections": 301}, "max_detections"),
    ({"max_detections": "ten"}, "max_detections"),
    ({"max_detections": True}, "max_detections"),
    ({"classes": ["unicorn"]}, "classes"),
    ({"classes": [99]}, "classes"),
    ({"classes": []}, "classes"),
])
def test_malformed_or_out_of_range_values_are_400(fields, message):
    with pytest.raises(ClientError) as caught:
        parse({"body": {"data": "x", **fields}})
    assert caught.value.status == 400 and message in caught.value.message


@pytest.mark.parametrize(("row", "headers", "agnostic"), [
    ({"body": {"data": "x", "agnostic_nms": True}}, {}, True),
    ({"body": {"data": "x", "agnostic_nms": False}}, {"X-Agnostic-NMS": "true"}, False),   # the body wins
    ({"body": bytearray(b"img")}, {"X-Agnostic-NMS": "True"}, True),
    ({"body": bytearray(b"img")}, {"X-Agnostic-NMS": "0"}, False),
    ({"data": bytearray(b"img"), "agnostic_nms": bytearray(b"yes")}, {}, True),          # a form field
])
def test_class_agnostic_nms_from_a_json_field_a_form_field_or_a_header(row, headers, agnostic):
    assert parse(row, headers).agnostic_nms is agnostic


@pytest.mark.parametrize("value", ["maybe", 2, 0.5, ["true"]])
def test_a_class_agnostic_nms_that_is_not_true_or_false_is_400(value):
    with pytest.raises(ClientError) as caught:
        parse({"body": {"data": "x", "agnostic_nms": value}})
    assert caught.value.status == 400 and "agnostic_nms" in caught.value.message


def test_a_detector_whose_nms_is_not_run_here_refuses_class_agnostic_nms_only():
    def without_nms(row, headers):
        return parse_detection_options(row, headers.get, DEFAULTS, LABELS, 300, nms_here=False)

    assert without_nms({"body": {"data": "x", "agnostic_nms": False}}, {}).agnostic_nms is False
    with pytest.raises(ClientError) as caught:
        without_nms({"body": bytearray(b"img")}, {"X-Agnostic-NMS": "true"})
    assert caught.value.status == 400 and "NMS is not run here" in caught.value.message
