"""TorchServe entry module for image classification (exactly one handler class, a TorchServe rule).

Per request: raw image bytes, a multipart upload or JSON {"data": "<base64>"} ->
`[{"label": str, "index": int, "probability": float}, ...]`, the top-k classes, best first
(k: the archive's `top_k`, or the request's own: see `handlers.request.classification_options`). An
Open Inference Protocol request gets labels, probabilities and class ids as v2 tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from handlers.drift.drift_features import Observation, classification_observations
from handlers.ground.decoded_requests import DecodedImage
from handlers.ground.kind_options import ClassificationOptions
from handlers.model.classifier_model import ClassifierModel
from handlers.model.compiled_model import Runner
from handlers.model.settings import ClassifierSettings, parse_classifier_settings
from handlers.request.classification_options import OPTION_FIELDS, parse_classification_options
from handlers.request.inference_protocol import (
    CLASSIFICATION_OUTPUTS,
    OutputSpec,
    TensorOutput,
    classification_outputs,
)
from handlers.serving import BatchedImageHandler, HeaderReader, required_serialized_file
from handlers.shadow.answer_comparison import AnswerComparison, compare_classifications
from handlers.task.classification import ClassScore, top_k_of_probabilities

Item = DecodedImage[ClassificationOptions]


class ImageClassifierHandler(
        BatchedImageHandler[ClassificationOptions, torch.Tensor, torch.Tensor, ClassifierSettings]):
    classifier: ClassifierModel
    model: Runner  # the compiled package when it may run here, else the eager network
    option_fields = OPTION_FIELDS

    def parse_settings(self, handler_section: Mapping[str, Any]) -> ClassifierSettings:
        return parse_classifier_settings(handler_section)

    def load(self, serialized_file: str | None) -> None:
        self.classifier = ClassifierModel(self.settings, self.model_dir,
                                          required_serialized_file(serialized_file), self.device)
        self.labels, self.precision = self.classifier.labels, self.classifier.precision
        self.network, self.model = self.classifier.network, self.classifier.run
        self.runners = {"classifier": self.classifier.runner}
        self.jpeg_draft_size = self.settings.resize_size if self.settings.jpeg_draft else None

    def parse_options(self, row: Mapping[str, Any], header: HeaderReader) -> ClassificationOptions:
        return parse_classification_options(row, header, self.settings.top_k, len(self.labels))

    def near_duplicate_image(self, item: Item) -> torch.Tensor:
        return item.image

    def preprocess(self, items: Sequence[Item]) -> torch.Tensor:
        return self.classifier.model_input([item.image for item in items])

    def infer(self, model_input: torch.Tensor) -> torch.Tensor:
        return self.model(model_input)

    def postprocess(self, model_output: torch.Tensor, model_input: torch.Tensor,
                    items: Sequence[Item]) -> list[list[ClassScore]]:
        top_ks = [item.options.top_k for item in items]
        ranked = top_k_of_probabilities(self.classifier.probabilities(model_output), self.labels,
                                        max(top_ks))
        return [scores[:k] for scores, k in zip(ranked, top_ks, strict=True)]

    def answer_observations(self, answer: list[ClassScore]) -> list[Observation]:
        return classification_observations(answer, len(self.labels))

    def v2_outputs(self, answer: list[ClassScore]) -> list[TensorOutput]:
        return classification_outputs(answer)

    def v2_output_specs(self) -> Sequence[OutputSpec]:
        return CLASSIFICATION_OUTPUTS

    def compare_answers(self, production: Any, candidate: Any) -> AnswerComparison:
        return compare_classifications(production, candidate)

    def warm_up(self, batch_size: int) -> None:
        self.classifier.warm_up(batch_size)
        self.model = self.classifier.run       # a CUDA worker's runs its batches in buckets from here
