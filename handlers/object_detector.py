"""TorchServe entry module for object detection (exactly one handler class, a TorchServe rule).

Two kinds of model, torchvision detectors and YOLO-style single-tensor models: see
`handlers.model.detector_formats` (the strategy is chosen once, when the worker loads the model).

Per request -> `[{"label": str, "index": int, "score": float, "box": [x1, y1, x2, y2]}, ...]` in
the original image's pixels (after EXIF orientation), clipped to it, best first; `[]` when nothing
is found. Options per request: see `handlers.request.detection_options`. An Open Inference Protocol
request gets boxes, scores, labels and class ids as v2 tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from handlers.drift.drift_features import Observation, detection_observations
from handlers.ground.decoded_requests import DecodedImage
from handlers.ground.kind_options import DetectionOptions
from handlers.model.detector_model import DetectorModel
from handlers.model.settings import DetectorSettings, parse_detector_settings
from handlers.request.detection_options import OPTION_FIELDS, parse_detection_options
from handlers.request.inference_protocol import (
    DETECTION_OUTPUTS,
    OutputSpec,
    TensorOutput,
    detection_outputs,
)
from handlers.serving import BatchedImageHandler, HeaderReader, required_serialized_file
from handlers.shadow.answer_comparison import AnswerComparison, compare_detections
from handlers.task.detection import Detection, DetectorInput, format_detections

Item = DecodedImage[DetectionOptions]


class ObjectDetectorHandler(
        BatchedImageHandler[DetectionOptions, DetectorInput, Any, DetectorSettings]):
    detector: DetectorModel
    option_fields = OPTION_FIELDS

    def parse_settings(self, handler_section: Mapping[str, Any]) -> DetectorSettings:
        return parse_detector_settings(handler_section)

    def load(self, serialized_file: str | None) -> None:
        self.detector = DetectorModel(self.settings, self.model_dir,
                                      required_serialized_file(serialized_file), self.device)
        self.labels, self.precision = self.detector.labels, self.detector.precision
        self.network = self.detector.network
        self.runners = {"detector": self.detector.runner}

    def parse_options(self, row: Mapping[str, Any], header: HeaderReader) -> DetectionOptions:
        return parse_detection_options(row, header, self.settings.defaults, self.labels,
                                       self.settings.max_detections_cap,
                                       nms_here=self.settings.runs_nms)

    def preprocess(self, items: Sequence[Item]) -> DetectorInput:
        return self.detector.model_input([item.image for item in items],
                                         [item.options for item in items])

    def infer(self, model_input: DetectorInput) -> Any:
        return self.detector.forward(model_input)

    def postprocess(self, model_output: Any, model_input: DetectorInput,
                    items: Sequence[Item]) -> list[list[Detection]]:
        found = self.detector.detections(model_output, model_input, [item.image for item in items],
                                         [item.options for item in items])
        return [format_detections(detections, self.labels) for detections in found]

    def answer_observations(self, answer: list[Detection]) -> list[Observation]:
        return detection_observations(answer, len(self.labels))

    def v2_outputs(self, answer: list[Detection]) -> list[TensorOutput]:
        return detection_outputs(answer)

    def v2_output_specs(self) -> Sequence[OutputSpec]:
        return DETECTION_OUTPUTS

    def compare_answers(self, production: Any, candidate: Any) -> AnswerComparison:
        return compare_detections(production, candidate)

    def warm_up(self, batch_size: int) -> None:
        self.detector.warm_up(batch_size)
