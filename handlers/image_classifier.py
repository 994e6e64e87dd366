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
from handlers.compiled_model import MachineTarget, Runner, compiled_or_eager
from handlers.decode import decode_image_bytes
from handlers.inference_protocol import TensorOutput, classification_outputs
from handlers.model_loading import autocast
from handlers.request_body import extract_image_bytes
from handlers.serving import BatchedImageHandler, HeaderReader
from handlers.settings import ClassifierSettings, parse_classifier_settings
from handlers.transforms import preprocess_classification_batch


class ImageClassifierHandler(
        BatchedImageHandler[ClassificationRequest, torch.Tensor, torch.Tensor, ClassifierSettings]):
    model: Runner  # the compiled package when it may run here, else `eager_forward`

    def parse_settings(self, handler_section: Mapping[str, Any]) -> ClassifierSettings:
        return parse_classifier_settings(handler_section)

    def prepare_model(self) -> None:
        if self.settings.channels_last:
            self.network = self.network.to(memory_format=torch.channels_last)
        timeout_s = self.settings.compile.load_timeout_s if self.settings.compile else 0.0
        self.model, self.runner, self.compiled_refusal = compiled_or_eager(
            self.settings.compiled_packages, self.model_dir,
            MachineTarget.here(self.device, self.precision), self.eager_forward, timeout_s)

    def decode_request(self, row: Mapping[str, Any], header: HeaderReader) -> ClassificationRequest:
        settings = self.settings
        top_k = parse_top_k(row, header, settings.top_k, len(self.labels))
        image = decode_image_bytes(extract_image_bytes(row, OPTION_FIELDS), settings.limits,
                                   self.device, settings.resize_size if settings.jpeg_draft else None)
        return ClassificationRequest(image, top_k)

    def preprocess(self, items: Sequence[ClassificationRequest]) -> torch.Tensor:
        batch = preprocess_classification_batch(
            [item.image for item in items],
            self.settings.resize_size,
            self.settings.input_size,
            self.settings.mean,
            self.settings.std,
            self.device,
        )
        if self.settings.channels_last:
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch

    def eager_forward(self, batch: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.precision):
            return self.network(batch)

    def infer(self, model_input: torch.Tensor) -> torch.Tensor:
        return self.model(model_input)

    def postprocess(self, model_output: torch.Tensor, model_input: torch.Tensor,
                    items: Sequence[ClassificationRequest]) -> list[list[ClassScore]]:
        ranked = top_k_classes(model_output, self.labels, max(item.top_k for item in items))
        return [scores[: item.top_k] for scores, item in zip(ranked, items, strict=True)]

    def v2_outputs(self, answer: list[ClassScore]) -> list[TensorOutput]:
        return classification_outputs(answer)

    def warm_up(self, batch_size: int) -> None:
        size = self.settings.input_size
        # The compiled package has one dynamic batch dimension: the two ends warm it too.
        sizes = sorted({1, batch_size})
        memory_format = torch.channels_last if self.settings.channels_last else torch.contiguous_format
        with torch.inference_mode():
            for count in sizes:
                batch = torch.zeros(count, 3, size, size, device=self.device)
                self.infer(batch.contiguous(memory_format=memory_format))
