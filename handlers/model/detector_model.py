"""One detection network ready to serve on a device: its settings, class names, precision and
output format (torchvision detector or YOLO-style; see `handlers.model.detector_formats`).

Used by the object detector and by the detect-then-classify pipeline.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from handlers.model.detector_formats import DetectorFormat, detector_format
from handlers.model.model_loading import autocast, load_for_serving
from handlers.model.settings import DetectorSettings
from handlers.task.detection import (
    DetectionOptions,
    DetectionTensors,
    DetectorInput,
    lowest_score_asked,
)

WARM_UP_SIZE_HW = (480, 640)


class DetectorModel:
    """`labels`, `precision` (what runs here), `network` (eager, on `device`), `format`."""

    def __init__(self, settings: DetectorSettings, model_dir: Path, serialized_file: str,
                 device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self.labels, self.precision, self.network = load_for_serving(settings, model_dir,
                                                                     serialized_file, device)
        self.format: DetectorFormat = detector_format(settings.output_format, settings.input_size,
                                                      settings.letterbox_fill)
        self._running = threading.Lock()    # a batch's settings of the network hold for its forward

    def model_input(self, images: Sequence[torch.Tensor],
                    options: Sequence[DetectionOptions] | None = None) -> DetectorInput:
        """`uint8[3, H_i, W_i]` images -> the network's input (and letterbox geometry); with the
        requests' `options`, the network keeps only candidates some request can be answered
        (`handlers.task.detection.candidate_score_threshold`), without them every candidate."""
        return self.format.model_input(images, self.device, lowest_score_asked(options))

    def forward(self, model_input: DetectorInput) -> Any:
        with self._running, autocast(self.device, self.precision), \
                self.format.running_batch(self.network, model_input):
            return self.format.model_output(self.network(model_input.images))

    def detections(self, output: Any, model_input: DetectorInput, images: Sequence[torch.Tensor],
                   options: Sequence[DetectionOptions]) -> list[DetectionTensors]:
        """Each image's detections under its request's options: boxes `float[N, 4]` xyxy in its
        own pixels (clipped), best first."""
        return self.format.detections(output, model_input, images, options)

    def warm_up(self, batch_size: int) -> None:
        image = torch.zeros(3, *WARM_UP_SIZE_HW, dtype=torch.uint8, device=self.device)
        with torch.inference_mode():
            for count in sorted({1, batch_size}):
                self.forward(self.model_input([image] * count))
