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

from handlers.decode import decode_image_bytes
from handlers.detection import (
    Detection,
    DetectionOptions,
    DetectionRequest,
    DetectorInput,
    format_detections,
)
from handlers.detection_options import OPTION_FIELDS, parse_detection_options
from handlers.detector_model import DetectorModel
from handlers.inference_protocol import TensorOutput, detection_outputs
from handlers.request_body import extract_image_bytes
from handlers.request_options import canonical_text
from handlers.serving import BatchedImageHandler, HeaderReader, required_serialized_file
from handlers.settings import DetectorSettings, parse_detector_settings


class ObjectDetectorHandler(
        BatchedImageHandler[DetectionRequest, DetectorInput, Any, DetectorSettings]):
    detector: DetectorModel

    def parse_settings(self, handler_section: Mapping[str, Any]) -> DetectorSettings:
        return parse_detector_settings(handler_section)

    def load(self, handler_settings: Mapping[str, Any], serialized_file: str | None) -> None:
        self.settings = self.parse_settings(handler_settings)
        self.detector = DetectorModel(self.settings, self.model_dir,
                                      required_serialized_file(serialized_file), self.device)
        self.labels, self.precision = self.detector.labels, self.detector.precision
        self.network = self.detector.network

    def request_options(self, row: Mapping[str, Any], header: HeaderReader) -> DetectionOptions:
        return parse_detection_options(row, header, self.settings.defaults, self.labels,
                                       self.settings.max_detections_cap)

    def cache_key_material(self, row: Mapping[str, Any], header: HeaderReader) -> tuple[bytes, str]:
        options = self.request_options(row, header)
        return extract_image_bytes(row, OPTION_FIELDS), canonical_text(options)

    def decode_request(self, row: Mapping[str, Any], header: HeaderReader) -> DetectionRequest:
        options = self.request_options(row, header)
        image = decode_image_bytes(extract_image_bytes(row, OPTION_FIELDS), self.settings.limits,
                                   self.device)
        return DetectionRequest(image, options)

    def preprocess(self, items: Sequence[DetectionRequest]) -> DetectorInput:
        return self.detector.model_input([item.image for item in items])

    def infer(self, model_input: DetectorInput) -> Any:
        return self.detector.forward(model_input)

    def postprocess(self, model_output: Any, model_input: DetectorInput,
                    items: Sequence[DetectionRequest]) -> list[list[Detection]]:
        found = self.detector.detections(model_output, model_input, [item.image for item in items],
                                         [item.options for item in items])
        return [format_detections(detections, self.labels) for detections in found]

    def v2_outputs(self, answer: list[Detection]) -> list[TensorOutput]:
        return detection_outputs(answer)

    def warm_up(self, batch_size: int) -> None:
        self.detector.warm_up(batch_size)
