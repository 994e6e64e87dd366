"""TorchServe entry module for a confidence cascade of two classifiers (exactly one handler class).

Both models live in the worker. Per batch, the first (cheap) model runs on every request; the
requests whose answer is not confident enough (see `handlers.task.cascade`), or that ask for it, run
through the second model as one sub-batch. Each answer is the classifier's list of top-k classes
`[{"label", "index", "probability", "model"}, ...]`, where `model` names the stage archive that
produced it (`<name>-<version>`), also in the `X-Answered-By` response header; a client of the
plain classifier reads it unchanged. Options per request: `handlers.request.cascade_options`.
Metrics: HandlerEscalatedRequests (counter) and HandlerEscalationRate (the batch's share).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from handlers.batch.batch_record import BatchRecord
from handlers.ground.decoded_requests import DecodedImage
from handlers.ground.kind_options import CascadeOptions
from handlers.model.classifier_model import ClassifierModel
from handlers.model.pipeline_settings import CascadeSettings, StageArchive, parse_cascade_settings
from handlers.request.cascade_options import OPTION_FIELDS, parse_cascade_options
from handlers.request.inference_protocol import (
    CLASSIFICATION_OUTPUTS,
    OutputSpec,
    TensorOutput,
    classification_outputs,
    tensor,
)
from handlers.serving import BatchedImageHandler, HeaderReader
from handlers.shadow.answer_comparison import AnswerComparison, compare_classifications
from handlers.task.cascade import CascadeInput, CascadeOutput, confidences, escalated
from handlers.task.classification import ClassScore, top_k_of_probabilities

ANSWERED_BY_HEADER = "X-Answered-By"
Item = DecodedImage[CascadeOptions]


class ClassificationCascadeHandler(
        BatchedImageHandler[CascadeOptions, CascadeInput, CascadeOutput, CascadeSettings]):
    first: ClassifierModel
    second: ClassifierModel
    option_fields = OPTION_FIELDS

    def parse_settings(self, handler_section: Mapping[str, Any]) -> CascadeSettings:
        return parse_cascade_settings(handler_section)

    def load(self, serialized_file: str | None) -> None:
        self.first = self.stage_model(self.settings.first, self.settings.first_classifier)
        self.second = self.stage_model(self.settings.second, self.settings.second_classifier)
        if self.first.labels != self.second.labels:
            raise ValueError(f"the stages {self.settings.first.archive} and "
                             f"{self.settings.second.archive} have different classes")
        self.labels, self.precision = self.first.labels, self.first.precision
        self.runners = {"first": self.first.runner, "second": self.second.runner}
        first, second = self.settings.first_classifier, self.settings.second_classifier
        if first.jpeg_draft and second.jpeg_draft:
            self.jpeg_draft_size = max(first.resize_size, second.resize_size)

    def stage_model(self, stage: StageArchive, settings: Any) -> ClassifierModel:
        return ClassifierModel(settings, self.model_dir / stage.directory, stage.serialized_file,
                               self.device)

    def parse_options(self, row: Mapping[str, Any], header: HeaderReader) -> CascadeOptions:
        return parse_cascade_options(row, header, self.settings.top_k,
                                     self.settings.escalation.threshold, len(self.labels))

    def near_duplicate_image(self, item: Item) -> torch.Tensor:
        return item.image

    def preprocess(self, items: Sequence[Item]) -> CascadeInput:
        return CascadeInput(self.first.model_input([item.image for item in items]), items)

    def infer(self, model_input: CascadeInput) -> CascadeOutput:
        requests = model_input.requests
        probabilities = self.first.probabilities(self.first.logits(model_input.first_batch))
        needs_second = escalated(confidences(probabilities, self.settings.escalation.rule),
                                 [request.options for request in requests])
        chosen = [index for index, escalate in enumerate(needs_second) if escalate]
        if chosen:
            second_batch = self.second.model_input([requests[index].image for index in chosen])
            second = self.second.probabilities(self.second.logits(second_batch))
            probabilities[torch.tensor(chosen, device=probabilities.device)] = second
        return CascadeOutput(probabilities, needs_second)

    def postprocess(self, model_output: CascadeOutput, model_input: CascadeInput,
                    items: Sequence[Item]) -> list[list[dict[str, Any]]]:
        top_ks = [item.options.top_k for item in items]
        ranked = top_k_of_probabilities(model_output.probabilities, self.labels, max(top_ks))
        names = (self.settings.first.archive, self.settings.second.archive)
        return [[{**score, "model": names[escalate]} for score in scores[:k]]
                for scores, k, escalate in zip(ranked, top_ks, model_output.escalated, strict=True)]

    def record_answers(self, record: BatchRecord, answers: Sequence[Any]) -> None:
        count = sum(answer[0]["model"] == self.settings.second.archive for answer in answers)
        record.counters["EscalatedRequests"] = count
        record.gauges["EscalationRate"] = round(count / len(answers), 4)

    def answer_headers(self, answer: list[dict[str, Any]]) -> Mapping[str, str]:
        return {ANSWERED_BY_HEADER: answer[0]["model"]}

    def v2_outputs(self, answer: list[dict[str, Any]]) -> list[TensorOutput]:
        scores = [ClassScore(label=a["label"], index=a["index"], probability=a["probability"])
                  for a in answer]
        return [*classification_outputs(scores), tensor("model", "BYTES", [1], [answer[0]["model"]])]

    def v2_output_specs(self) -> Sequence[OutputSpec]:
        return (*CLASSIFICATION_OUTPUTS, OutputSpec("model", "BYTES", (1,)))

    def compare_answers(self, production: Any, candidate: Any) -> AnswerComparison:
        return compare_classifications(production, candidate)

    def warm_up(self, batch_size: int) -> None:
        self.first.warm_up(batch_size)
        self.second.warm_up(batch_size)
