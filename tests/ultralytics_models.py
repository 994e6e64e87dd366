"""Ultralytics networks for tests, built from the yaml files inside the `ultralytics` package (a
test dependency only: AGPL-3.0; nothing is downloaded) and given a trained network's load, then
exported the way Ultralytics documents it (`model.export(format=..., imgsz=...)`).

A freshly initialised network scores every class alike (its batch norms' running statistics are
0 and 1, so the features reaching the heads are about 1e-7). `calibrated` sets those statistics
from a batch of real photos (one forward pass in train mode, cumulative averages) and the class
biases of the detection head, so that its answers differ from photo to photo and move with the
input's pixels as a trained network's do (../shared/MODELS.md).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from tests.detections import Row, rows_from_answer
from tests.images import PHOTOS_DIR, encode, exif_with_orientation

CALIBRATION_PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png", "motorcycle_left.png", "rocket.jpg")
# The detection head's class bias after calibration: at -6, YOLOv8n finds 0 to 300 boxes per
# photo above Ultralytics' 0.25 (0 on most, dozens on the astronaut and the motorcycles).
DETECTION_CLASS_BIAS = -6.0
# A classification head's logits scaled by this: a calibrated network's are otherwise so close
# that every probability is about 1 / classes, and its top-5 would not show a pixel's difference.
CLASSIFICATION_LOGIT_SCALE = 40.0


@contextmanager
def offline_ultralytics() -> Iterator[None]:
    """Ultralytics without the network (its `is_online()` looks up public DNS names otherwise) and
    with its settings file in a folder of its own, not the user's."""
    saved = {key: os.environ.get(key) for key in ("YOLO_OFFLINE", "YOLO_CONFIG_DIR", "YOLO_VERBOSE")}
    with tempfile.TemporaryDirectory(prefix="ultralytics-settings-") as settings:
        os.environ.update({"YOLO_OFFLINE": "true", "YOLO_CONFIG_DIR": settings, "YOLO_VERBOSE": "false"})
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def calibration_batch(size: int) -> torch.Tensor:
    images = [np.asarray(Image.open(PHOTOS_DIR / name).convert("RGB").resize((size, size)))
              for name in CALIBRATION_PHOTOS]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255


def calibrated(yaml_name: str, seed: int = 0, size: int = 640) -> Any:
    """`YOLO(yaml_name)` (e.g. "yolov8n.yaml", "yolo11n.yaml", "yolov8n-cls.yaml") under `seed`,
    its batch norms' statistics set from the calibration photos at `size`, a detector's class
    biases set to DETECTION_CLASS_BIAS."""
    from ultralytics import YOLO

    torch.manual_seed(seed)
    model: Any = YOLO(yaml_name)
    network = model.model
    for module in network.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None
    network.train()
    with torch.no_grad():
        network(calibration_batch(size))
    network.eval()
    head = network.model[-1]
    for branches in ("cv3", "one2one_cv3"):                 # a Detect head's class branches (the
        for branch in getattr(head, branches, ()):          # second: an end-to-end head's)
            branch[-1].bias.data.fill_(DETECTION_CLASS_BIAS)
    if hasattr(head, "linear"):                             # a Classify head
        with torch.no_grad():
            head.linear.weight.mul_(CLASSIFICATION_LOGIT_SCALE)
            head.linear.bias.mul_(CLASSIFICATION_LOGIT_SCALE)
    return model


def exported(yaml_name: str, export_format: str, directory: Path, size: int = 640,
             **export_args: Any) -> Path:
    """The calibrated network saved in `directory` and exported there (`torchscript`, `onnx`),
    as Ultralytics writes it: `<name>.torchscript` / `<name>.onnx` beside `<name>.pt`."""
    with offline_ultralytics():
        model = calibrated(yaml_name, size=size)
        directory.mkdir(parents=True, exist_ok=True)
        checkpoint = directory / f"{Path(yaml_name).stem}.pt"
        model.save(str(checkpoint))
        from ultralytics import YOLO

        return Path(YOLO(str(checkpoint)).export(format=export_format, imgsz=size, **export_args))


def predicted(export: Path, image: Path | np.ndarray, task: str = "detect") -> Any:
    """Ultralytics' own `predict` on `export` with its defaults: the first Results."""
    from ultralytics import YOLO

    with offline_ultralytics():
        source = str(image) if isinstance(image, Path) else image
        model: Any = YOLO(str(export), task=task)
        return model.predict(source, verbose=False)[0]


# The photos the served answers are compared on, as files a user would send: PNG and JPEG,
# landscape, portrait and square, smaller and larger than a 640 input, one whose EXIF orientation
# turns it (decoded upright by both sides), one a JPEG with chroma subsampling (Pillow's default).
def comparison_photos() -> dict[str, bytes]:
    def photo(name: str) -> Image.Image:
        return Image.open(PHOTOS_DIR / name).convert("RGB")

    astronaut, motorcycle = photo("astronaut.png"), photo("motorcycle_left.png")
    right, horse = photo("motorcycle_right.png"), photo("horse.png")
    return {
        "astronaut.png": (PHOTOS_DIR / "astronaut.png").read_bytes(),                 # 512 x 512
        "motorcycle_left.png": (PHOTOS_DIR / "motorcycle_left.png").read_bytes(),     # 500 x 741
        "rocket.jpg": (PHOTOS_DIR / "rocket.jpg").read_bytes(),                       # 427 x 640
        "horse-small.png": encode(horse.resize((220, 164)), "PNG"),
        "motorcycle-portrait.jpg": encode(right.resize((600, 900)), "JPEG", quality=92),
        "motorcycle-large.jpg": encode(motorcycle.resize((1280, 864)), "JPEG", quality=90),
        "astronaut-tall.png": encode(astronaut.resize((300, 700)), "PNG"),
        # stored on its side, EXIF orientation 6: shown (and decoded) rotated upright
        "astronaut-exif.jpg": encode(astronaut.resize((480, 360)).transpose(Image.Transpose.ROTATE_90),
                                     "JPEG", quality=95, exif=exif_with_orientation(6)),
    }


def reference_rows(result: Any) -> list[Row]:
    """Ultralytics' Results of a detection as (class, score, box) rows, best first."""
    boxes = result.boxes
    return list(zip(boxes.cls.long().tolist(), boxes.conf.tolist(), boxes.xyxy.tolist(), strict=True))


# How far a served detection may be from Ultralytics' own: boxes (rounded to 0.01 px in the JSON
# answer) and scores as float32 computes them, in batches of several sizes (the network's
# arithmetic changes a little with the batch size, and with the runner: OpenVINO's kernels for a
# TorchScript export; alone on the export, both sides give the same bits).
BOX_BOUND_PX = 1.0
SCORE_BOUND = 1e-3
# Ultralytics' predict defaults, which the archives of its exports keep.
NMS_IOU_THRESHOLD = 0.7
MAX_DETECTIONS = 300
# NMS is discontinuous: where a box overlaps a better one by about the IoU threshold, rounding
# decides whether it is suppressed. The boxes' own rounding moves an IoU by far less than this.
NMS_IOU_BOUND = 0.01


def assert_ultralytics_answer(served: list[dict[str, Any]], result: Any, threshold: float,
                              nms: str = "per class") -> None:
    """The served detections are Ultralytics' own Results (`assert_detections_within`)."""
    assert_detections_within(served, reference_rows(result), threshold, nms)


def box_iou(first: list[float], second: list[float]) -> float:
    width = min(first[2], second[2]) - max(first[0], second[0])
    height = min(first[3], second[3]) - max(first[1], second[1])
    inter = max(width, 0.0) * max(height, 0.0)
    area = ((first[2] - first[0]) * (first[3] - first[1]) + (second[2] - second[0]) * (second[3] - second[1]))
    return inter / (area - inter) if area > inter else 0.0


def matched(rows: list[Row], expected: list[Row]) -> tuple[list[Row], list[Row]]:
    """Rows of both sides matched one to one by class, score within SCORE_BOUND and box within
    BOX_BOUND_PX; the rows of each side left without a match."""
    left_over, unmatched = [], list(expected)
    for index, score, box in rows:
        match = next((row for row in unmatched if row[0] == index and abs(row[1] - score) <= SCORE_BOUND
                      and max(abs(a - b) for a, b in zip(row[2], box, strict=True)) <= BOX_BOUND_PX), None)
        if match is None:
            left_over.append((index, score, box))
        else:
            unmatched.remove(match)
    return left_over, unmatched


def decided_by_rounding(row: Row, other: list[Row], other_left_over: list[Row], threshold: float,
                        nms: str) -> bool:
    """Whether `row` may be missing from the other side's `other` detections because a decision
    of float32's reach took it out there (or kept it here):
    - its score is within SCORE_BOUND of the score threshold;
    - the other side is full (MAX_DETECTIONS) and `row` scores no better than its last;
    - there a detection NMS compares it with (its class; any class when `nms` is "agnostic";
      none when "none", an end-to-end head's), scoring at
      least as well, overlaps it by the IoU threshold within NMS_IOU_BOUND, or by more while the
      two scores tie within SCORE_BOUND (either suppresses the other) or while that detection is
      itself one that only one side kept (the cascade of such a decision).
    Each row a wrong NMS would keep or drop (another threshold, another order) meets none."""
    index, score, box = row
    if abs(score - threshold) <= SCORE_BOUND:
        return True
    if len(other) >= MAX_DETECTIONS and score <= min(found for _, found, _ in other) + SCORE_BOUND:
        return True
    for other_row in other if nms != "none" else []:
        other_index, other_score, other_box = other_row
        if (nms == "per class" and other_index != index) or other_score < score - SCORE_BOUND:
            continue
        iou = box_iou(box, other_box)
        if iou <= NMS_IOU_THRESHOLD - NMS_IOU_BOUND:
            continue
        if (iou <= NMS_IOU_THRESHOLD + NMS_IOU_BOUND or abs(other_score - score) <= SCORE_BOUND
                or other_row in other_left_over):
            return True
    return False


def assert_detections_within(served: list[dict[str, Any]], expected: list[Row], threshold: float,
                             nms: str = "per class") -> None:
    """Each detection matched one to one by class, box within BOX_BOUND_PX and score within
    SCORE_BOUND, except those that a decision within rounding kept on one side only
    (`decided_by_rounding`). At least 95% of either side are matched."""
    got = rows_from_answer(served)
    got_left_over, expected_left_over = matched(got, expected)
    for left_over, other, other_left_over, side in ((got_left_over, expected, expected_left_over, "served"),
                                                    (expected_left_over, got, got_left_over, "Ultralytics'")):
        unexplained = [row for row in left_over
                       if not decided_by_rounding(row, other, other_left_over, threshold, nms)]
        assert not unexplained, f"{side} detections the other side has not: {unexplained}"
    for left_over, rows in ((got_left_over, got), (expected_left_over, expected)):
        assert len(left_over) <= 0.05 * len(rows) + 1, (len(left_over), len(rows))
