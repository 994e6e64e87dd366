"""TorchServe entry module for image classification (exactly one handler class, a TorchServe rule).

Per request: raw image bytes, a multipart upload or JSON {"data": "<base64>"} ->
`[{"label": str, "index": int, "probability": float}, ...]`, the top-k classes, best first
(k: the archive's `top_k`, or the request's own: see `handlers.classification_options`). An
Open Inference Protocol request gets labels, probabilities and class ids as v2 tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from handlers.classification import ClassificationRequest, ClassScore, top_k_classes
from handlers.classification_options import OPTION_FIELDS, parse_top_k
from handlers.classifier_model import ClassifierModel
from handlers.compiled_model import Runner
from handlers.decode import decode_image_bytes
from handlers.inference_protocol import TensorOutput, classification_outputs
from handlers.request_body import extract_image_bytes
from handlers.request_options import canonical_text
from handlers.serving import BatchedImageHandler, HeaderReader, required_serialized_file
from handlers.settings import ClassifierSettings, parse_classifier_settings


class ImageClassifierHandler(
        BatchedImageHandler[ClassificationRequest, torch.Tensor, torch.Tensor, ClassifierSettings]):
    classifier: ClassifierModel
    model: Runner  # the compiled package when it may run here, else the eager network

    def parse_settings(self, handler_section: Mapping[str, Any]) -> ClassifierSettings:
        return parse_classifier_settings(handler_section)

    def load(self, handler_settings: Mapping[str, Any], serialized_file: str | None) -> None:
        self.settings = self.parse_settings(handler_settings)
        self.classifier = ClassifierModel(self.settings, self.model_dir,
                                          required_serialized_file(serialized_file), self.device)
        self.labels, self.precision = self.classifier.labels, self.classifier.precision
        self.network, self.model = self.classifier.network, self.classifier.run
        self.runners = {"classifier": self.classifier.runner}

    def cache_key_material(self, row: Mapping[str, Any], header: HeaderReader) -> tuple[bytes, str]:
        top_k = parse_top_k(row, header, self.settings.top_k, len(self.labels))
        return extract_image_bytes(row, OPTION_FIELDS), canonical_text(top_k)

    def near_duplicate_image(self, item: ClassificationRequest) -> torch.Tensor:
        return item.image

    def decode_request(self, row: Mapping[str, Any], header: HeaderReader) -> ClassificationRequest:
        settings = self.settings
        top_k = parse_top_k(row, header, settings.top_k, len(self.labels))
        image = decode_image_bytes(extract_image_bytes(row, OPTION_FIELDS), settings.limits,
                                   self.device, settings.resize_size if settings.jpeg_draft else None)
        return ClassificationRequest(image, top_k)

    def preprocess(self, items: Sequence[ClassificationRequest]) -> torch.Tensor:
        return self.classifier.model_input([item.image for item in items])

    def infer(self, model_input: torch.Tensor) -> torch.Tensor:
        return self.model(model_input)

    def postprocess(self, model_output: torch.Tensor, model_input: torch.Tensor,
                    items: Sequence[ClassificationRequest]) -> list[list[ClassScore]]:
        ranked = top_k_classes(model_output, self.labels, max(item.top_k for item in items))
        return [scores[: item.top_k] for scores, item in zip(ranked, items, strict=True)]

    def v2_outputs(self, answer: list[ClassScore]) -> list[TensorOutput]:
        return classification_outputs(answer)

    def warm_up(self, batch_size: int) -> None:
        self.classifier.warm_up(batch_size)
