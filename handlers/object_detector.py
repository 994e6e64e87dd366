"""TorchServe entry module for object detection (exactly one handler class, a TorchServe rule).

Two kinds of model:
- torchvision detectors (Faster R-CNN, RetinaNet, FCOS, SSD, SSDlite) take a list of images of
  different sizes and return boxes in each image's own pixels: the batch is one forward pass over
  that list;
- YOLO-style single-tensor models (`[B, 4 + C, N]`: cx, cy, w, h in input pixels, then C class
  scores) get a letterboxed square batch; boxes are decoded, NMS'd per class on the device and
  mapped back through each image's recorded letterbox.

Per request -> `[{"label": str, "index": int, "score": float, "box": [x1, y1, x2, y2]}, ...]` in
the original image's pixels (after EXIF orientation), clipped to it, best first; `[]` when nothing
is found. Options per request: see `handlers.detection_options`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchvision.ops import clip_boxes_to_image
from torchvision.transforms.v2 import functional as F

from handlers.decode import decode_image_bytes
from handlers.detection import (
    Detection,
    DetectionOptions,
    DetectionRequest,
    Detections,
    DetectorInput,
    decode_yolo_output,
    format_detections,
    select_detections,
)
from handlers.detection_options import OPTION_FIELDS, parse_detection_options
from handlers.letterbox import Letterbox, boxes_to_original, letterbox_batch
from handlers.model_loading import autocast, load_labels, load_model, resolve_precision
from handlers.request_body import extract_image_bytes
from handlers.serving import BatchedImageHandler, HeaderReader
from handlers.settings import DetectorSettings, parse_detector_settings

WARM_UP_SIZE_HW = (480, 640)


class ObjectDetectorHandler(BatchedImageHandler[DetectionRequest, DetectorInput, Any]):
    settings: DetectorSettings
    model: nn.Module
    labels: list[str]
    precision: str  # what runs here: settings.precision where this device supports it, else fp32

    def load(self, handler_settings: Mapping[str, Any], serialized_file: str | None) -> None:
        self.settings = parse_detector_settings(handler_settings)
        if serialized_file is None:
            raise ValueError("the archive has no serialized model file (--serialized-file)")
        self.labels = load_labels(self.model_dir / self.settings.labels_file)
        self.precision = resolve_precision(self.settings.precision, self.device)
        self.model = load_model(self.settings.model, self.model_dir / serialized_file, self.device)

    def decode_request(self, row: Mapping[str, Any], header: HeaderReader) -> DetectionRequest:
        options = parse_detection_options(row, header, self.settings.defaults, self.labels,
                                          self.settings.max_detections_cap)
        image = decode_image_bytes(extract_image_bytes(row, OPTION_FIELDS), self.settings.limits,
                                   self.device)
        return DetectionRequest(image, options)

    def preprocess(self, items: Sequence[DetectionRequest]) -> DetectorInput:
        images = [item.image for item in items]
        if self.settings.output_format == "yolo":
            batch, letterboxes = letterbox_batch(images, self.settings.input_size,
                                                 self.settings.letterbox_fill, self.device)
            return DetectorInput(batch, letterboxes)
        return DetectorInput([F.to_dtype(image.to(self.device), torch.float32, scale=True)
                              for image in images])

    def infer(self, model_input: DetectorInput) -> Any:
        with autocast(self.device, self.precision):
            output = self.model(model_input.images)
        if self.settings.output_format == "yolo" and isinstance(output, (tuple, list)):
            output = output[0]  # some exports return (predictions, extras)
        return output

    def postprocess(self, model_output: Any, model_input: DetectorInput,
                    items: Sequence[DetectionRequest]) -> list[list[Detection]]:
        if model_input.letterboxes is not None:
            return [self._yolo_answer(raw, letterbox, item.options)
                    for raw, letterbox, item in zip(model_output, model_input.letterboxes, items,
                                                    strict=True)]
        return [self._torchvision_answer(found, item)
                for found, item in zip(model_output, items, strict=True)]

    def warm_up(self, batch_size: int) -> None:
        image = torch.zeros(3, *WARM_UP_SIZE_HW, dtype=torch.uint8, device=self.device)
        defaults = self.settings.defaults
        with torch.inference_mode():
            for count in sorted({1, batch_size}):
                self.infer(self.preprocess([DetectionRequest(image, defaults)] * count))

    def _torchvision_answer(self, found: Mapping[str, torch.Tensor],
                            item: DetectionRequest) -> list[Detection]:
        size_hw = (item.image.shape[-2], item.image.shape[-1])
        detections = Detections(clip_boxes_to_image(found["boxes"], size_hw), found["scores"],
                                found["labels"])
        return format_detections(select_detections(detections, item.options), self.labels)

    def _yolo_answer(self, raw: torch.Tensor, letterbox: Letterbox,
                     options: DetectionOptions) -> list[Detection]:
        boxes, scores, class_indices = decode_yolo_output(raw, options)
        return format_detections(Detections(boxes_to_original(boxes, letterbox), scores,
                                            class_indices), self.labels)
