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
# arithmetic changes a little with the batch size; alone, both sides give the same bits).
BOX_BOUND_PX = 1.0
SCORE_BOUND = 1e-3


def assert_ultralytics_answer(served: list[dict[str, Any]], result: Any, threshold: float) -> None:
    """The served detections are Ultralytics' own Results (`assert_detections_within`)."""
    assert_detections_within(served, reference_rows(result), threshold)


def assert_detections_within(served: list[dict[str, Any]], expected: list[Row], threshold: float) -> None:
    """The same count, each detection matched one to one by class, box within BOX_BOUND_PX and
    score within SCORE_BOUND. A detection of either side whose score is within SCORE_BOUND of
    `threshold` may be missing from the other (float32 rounding may put it on either side)."""
    got = rows_from_answer(served)

    def clear(rows: list[Row]) -> list[Row]:
        return [row for row in rows if abs(row[1] - threshold) > SCORE_BOUND]

    assert len(clear(got)) == len(clear(expected)), (len(got), len(expected))
    unmatched = list(expected)
    for index, score, box in got:
        match = next((row for row in unmatched if row[0] == index and abs(row[1] - score) <= SCORE_BOUND
                      and max(abs(a - b) for a, b in zip(row[2], box, strict=True)) <= BOX_BOUND_PX), None)
        if match is None and abs(score - threshold) <= SCORE_BOUND:
            continue
        assert match is not None, f"Ultralytics has no class {index} at {score} in {box}"
        unmatched.remove(match)
    assert not clear(unmatched), clear(unmatched)
