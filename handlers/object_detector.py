"""TorchServe entry module for object detection (exactly one handler class, a TorchServe rule).

Two kinds of model, torchvision detectors and YOLO-style single-tensor models: see
`handlers.detector_formats` (the strategy is chosen once, when the worker loads the model).

Per request -> `[{"label": str, "index": int, "score": float, "box": [x1, y1, x2, y2]}, ...]` in
the original image's pixels (after EXIF orientation), clipped to it, best first; `[]` when nothing
is found. Options per request: see `handlers.detection_options`. An Open Inference Protocol
request gets boxes, scores, labels and class ids as v2 tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from handlers.decode import decode_image_bytes
from handlers.detection import Detection, DetectionRequest, DetectorInput, format_detections
from handlers.detection_options import OPTION_FIELDS, parse_detection_options
from handlers.detector_formats import DetectorFormat, detector_format
from handlers.inference_protocol import TensorOutput, detection_outputs
from handlers.model_loading import autocast
from handlers.request_body import extract_image_bytes
from handlers.serving import BatchedImageHandler, HeaderReader
from handlers.settings import DetectorSettings, parse_detector_settings

WARM_UP_SIZE_HW = (480, 640)


class ObjectDetectorHandler(
        BatchedImageHandler[DetectionRequest, DetectorInput, Any, DetectorSettings]):
    format: DetectorFormat  # torchvision or YOLO-style, chosen once from the settings

    def parse_settings(self, handler_section: Mapping[str, Any]) -> DetectorSettings:
        return parse_detector_settings(handler_section)

    def prepare_model(self) -> None:
        self.format = detector_format(self.settings.output_format, self.settings.input_size,
                                      self.settings.letterbox_fill)

    def decode_request(self, row: Mapping[str, Any], header: HeaderReader) -> DetectionRequest:
        options = parse_detection_options(row, header, self.settings.defaults, self.labels,
                                          self.settings.max_detections_cap)
        image = decode_image_bytes(extract_image_bytes(row, OPTION_FIELDS), self.settings.limits,
                                   self.device)
        return DetectionRequest(image, options)

    def preprocess(self, items: Sequence[DetectionRequest]) -> DetectorInput:
        return self.format.model_input([item.image for item in items], self.device)

    def infer(self, model_input: DetectorInput) -> Any:
        with autocast(self.device, self.precision):
            return self.format.model_output(self.network(model_input.images))

    def postprocess(self, model_output: Any, model_input: DetectorInput,
                    items: Sequence[DetectionRequest]) -> list[list[Detection]]:
        found = self.format.detections(model_output, model_input, [item.image for item in items],
                                       [item.options for item in items])
        return [format_detections(detections, self.labels) for detections in found]

    def v2_outputs(self, answer: list[Detection]) -> list[TensorOutput]:
        return detection_outputs(answer)

    def warm_up(self, batch_size: int) -> None:
        image = torch.zeros(3, *WARM_UP_SIZE_HW, dtype=torch.uint8, device=self.device)
        defaults = self.settings.defaults
        with torch.inference_mode():
            for count in sorted({1, batch_size}):
                self.infer(self.preprocess([DetectionRequest(image, defaults)] * count))
