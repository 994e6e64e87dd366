"""TorchServe entry module for a detector followed by a classifier on the boxes it kept (exactly
one handler class, a TorchServe rule).

Per batch: the detector runs on every image; each request's boxes to classify (its best
`max_boxes`, of its `classify_classes` when given) are cropped from all images at once
(`handlers.task.box_crops`, one roi_align on the device) and classified together, in chunks of
`boxes.classify_batch_size`. The answer is the detector's
`[{"label", "index", "score", "box", "classification"}, ...]` where `classification` is the
classifier's top-k for that box (`[{"label", "index", "probability"}, ...]`), or null for a box
that was not classified. Options per request: `handlers.request.detect_classify_options`.
Metrics: HandlerClassifiedBoxes (counter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from handlers.batch.batch_record import BatchRecord
from handlers.ground.decoded_requests import DecodedImage
from handlers.ground.kind_options import DetectClassifyOptions
from handlers.model.classifier_model import ClassifierModel
from handlers.model.detector_model import DetectorModel
from handlers.model.pipeline_settings import DetectClassifySettings, parse_detect_classify_settings
from handlers.request.detect_classify_options import OPTION_FIELDS, parse_detect_classify_options
from handlers.request.inference_protocol import (
    DETECTION_OUTPUTS,
    OutputSpec,
    TensorOutput,
    detection_outputs,
    tensor,
)
from handlers.serving import BatchedImageHandler, HeaderReader
from handlers.shadow.answer_comparison import AnswerComparison, compare_detections
from handlers.task.box_crops import crop_boxes
from handlers.task.classification import ClassScore, top_k_of_probabilities
from handlers.task.detect_classify import PipelineInput, PipelineOutput, boxes_to_classify
from handlers.task.detection import DetectionTensors, format_detections

Item = DecodedImage[DetectClassifyOptions]


class DetectThenClassifyHandler(
        BatchedImageHandler[DetectClassifyOptions, PipelineInput, PipelineOutput,
                            DetectClassifySettings]):
    detector: DetectorModel
    classifier: ClassifierModel
    option_fields = OPTION_FIELDS

    def parse_settings(self, handler_section: Mapping[str, Any]) -> DetectClassifySettings:
        return parse_detect_classify_settings(handler_section)

    def load(self, serialized_file: str | None) -> None:
        settings = self.settings
        self.detector = DetectorModel(settings.detector_settings,
                                      self.model_dir / settings.detector.directory,
                                      settings.detector.serialized_file, self.device)
        self.classifier = ClassifierModel(settings.classifier_settings,
                                          self.model_dir / settings.classifier.directory,
                                          settings.classifier.serialized_file, self.device)
        self.labels, self.precision = self.detector.labels, self.detector.precision
        self.runners = {"detector": self.detector.runner, "classifier": self.classifier.runner}

    def torch_computes(self) -> bool:
        return True     # the detector's transform and postprocess and the crops run in torch

    def parse_options(self, row: Mapping[str, Any], header: HeaderReader) -> DetectClassifyOptions:
        return parse_detect_classify_options(row, header, self.settings, self.labels,
                                             len(self.classifier.labels))

    def preprocess(self, items: Sequence[Item]) -> PipelineInput:
        return PipelineInput(self.detector.model_input([item.image for item in items],
                                                       [item.options.detection for item in items]),
                             items)

    def infer(self, model_input: PipelineInput) -> PipelineOutput:
        requests = model_input.requests
        images = [request.image for request in requests]
        raw = self.detector.forward(model_input.detector_input)
        found = self.detector.detections(raw, model_input.detector_input, images,
                                         [request.options.detection for request in requests])
        chosen = [boxes_to_classify(detections, request.options.boxes)
                  for detections, request in zip(found, requests, strict=True)]
        return PipelineOutput(found, chosen, self.classify_boxes(images, found, chosen))

    def classify_boxes(self, images: Sequence[torch.Tensor], found: Sequence[DetectionTensors],
                       chosen: Sequence[list[int]]) -> list[torch.Tensor]:
        """Logits of the chosen boxes of every image: one crop operation, chunked forward passes."""
        boxes = [detections.boxes_xyxy[rows] for detections, rows in zip(found, chosen, strict=True)]
        crops = crop_boxes(images, boxes, self.classifier.settings.input_size)
        if crops.shape[0] == 0:
            logits = torch.zeros(0, len(self.classifier.labels), device=self.device)
        else:
            logits = torch.cat([self.classifier.logits(self.classifier.crops_input(chunk))
                                for chunk in crops.split(self.settings.classify_batch_size)])
        return list(logits.split([len(rows) for rows in chosen]))

    def postprocess(self, model_output: PipelineOutput, model_input: PipelineInput,
                    items: Sequence[Item]) -> list[list[dict[str, Any]]]:
        answers = []
        for detections, rows, logits, item in zip(model_output.detections, model_output.classified,
                                                  model_output.logits, items, strict=True):
            answer: list[dict[str, Any]] = [{**d, "classification": None}
                                            for d in format_detections(detections, self.labels)]
            if rows:
                ranked = top_k_of_probabilities(self.classifier.probabilities(logits),
                                                self.classifier.labels, item.options.boxes.top_k)
                for row, scores in zip(rows, ranked, strict=True):
                    answer[row]["classification"] = scores
            answers.append(answer)
        return answers

    def record_answers(self, record: BatchRecord, answers: Sequence[Any]) -> None:
        record.counters["ClassifiedBoxes"] = sum(
            detection["classification"] is not None for answer in answers for detection in answer)

    def v2_outputs(self, answer: list[dict[str, Any]]) -> list[TensorOutput]:
        classified = [row for row, detection in enumerate(answer) if detection["classification"]]
        k = len(answer[classified[0]]["classification"]) if classified else 0
        scores: list[list[ClassScore]] = [answer[row]["classification"] for row in classified]
        return [*detection_outputs(answer),
                tensor("classified", "INT64", [len(classified)], classified),
                tensor("class_labels", "BYTES", [len(classified), k],
                       [score["label"] for row in scores for score in row]),
                tensor("class_probabilities", "FP32", [len(classified), k],
                       [score["probability"] for row in scores for score in row])]

    def v2_output_specs(self) -> Sequence[OutputSpec]:
        return (*DETECTION_OUTPUTS, OutputSpec("classified", "INT64", (-1,), ragged=True),
                OutputSpec("class_labels", "BYTES", (-1, -1), ragged=True),
                OutputSpec("class_probabilities", "FP32", (-1, -1), ragged=True))

    def compare_answers(self, production: Any, candidate: Any) -> AnswerComparison:
        return compare_detections(production, candidate)

    def warm_up(self, batch_size: int) -> None:
        self.detector.warm_up(batch_size)
        self.classifier.warm_up(min(self.settings.classify_batch_size, batch_size * 4))
