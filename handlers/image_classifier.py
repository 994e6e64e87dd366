"""TorchServe entry module for image classification (exactly one handler class, a TorchServe rule).

Per request: raw image bytes, a multipart upload or JSON {"data": "<base64>"} ->
`[{"label": str, "index": int, "probability": float}, ...]`, the top-k classes, best first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from handlers.classification import ClassScore, top_k_classes
from handlers.compiled_model import MachineTarget, Runner, compiled_or_eager
from handlers.decode import decode_image_bytes
from handlers.model_loading import autocast
from handlers.request_body import extract_image_bytes
from handlers.serving import BatchedImageHandler, HeaderReader
from handlers.settings import ClassifierSettings, parse_classifier_settings
from handlers.transforms import preprocess_classification_batch


class ImageClassifierHandler(
        BatchedImageHandler[torch.Tensor, torch.Tensor, torch.Tensor, ClassifierSettings]):
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

    def decode_request(self, row: Mapping[str, Any], header: HeaderReader) -> torch.Tensor:
        settings = self.settings
        return decode_image_bytes(extract_image_bytes(row), settings.limits, self.device,
                                  settings.resize_size if settings.jpeg_draft else None)

    def preprocess(self, items: Sequence[torch.Tensor]) -> torch.Tensor:
        batch = preprocess_classification_batch(
            items,
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
                    items: Sequence[torch.Tensor]) -> list[list[ClassScore]]:
        return top_k_classes(model_output, self.labels, self.settings.top_k)

    def warm_up(self, batch_size: int) -> None:
        size = self.settings.input_size
        # The compiled package has one dynamic batch dimension: the two ends warm it too.
        sizes = sorted({1, batch_size})
        memory_format = torch.channels_last if self.settings.channels_last else torch.contiguous_format
        with torch.inference_mode():
            for count in sizes:
                batch = torch.zeros(count, 3, size, size, device=self.device)
                self.infer(batch.contiguous(memory_format=memory_format))
