"""One detection network ready to serve on a device: its settings, class names, precision,
output format (torchvision detector or YOLO-style; see `handlers.model.detector_formats`) and
runner: an SSD-family detector whose archive has its backbone and head for OpenVINO or ONNX
Runtime runs them there when one passes its check (handlers.model.runner_selection), else the
eager network serves.

Used by the object detector and by the detect-then-classify pipeline.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from handlers.ground.kind_options import DetectionOptions
from handlers.model import model_loading
from handlers.model.compiled_model import MachineTarget
from handlers.model.detector_formats import DetectorFormat, detector_format
from handlers.model.model_loading import autocast, load_for_serving
from handlers.model.runner_selection import RunnerChoice, choose_detector_runner
from handlers.model.settings import DetectorSettings
from handlers.model.ssd_engine import SsdEngineDetector
from handlers.task.detection import DetectionTensors, DetectorInput, lowest_score_asked

WARM_UP_SIZE_HW = (480, 640)


class DetectorModel:
    """`labels`, `precision` (what runs here), `network` (eager, on `device`), `format`,
    `runner` (what serves the backbone and head, and what was refused), `run` (what serves)."""

    def __init__(self, settings: DetectorSettings, model_dir: Path, serialized_file: str,
                 device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self.labels, self.precision, self.network = load_for_serving(settings, model_dir,
                                                                     serialized_file, device)
        self.format: DetectorFormat = detector_format(settings.output_format, settings.input_size,
                                                      settings.letterbox_fill)
        self._running = threading.Lock()    # a batch's settings of the network hold for its forward
        timeout_s = settings.compile.load_timeout_s if settings.compile else 0.0
        native_bf16 = device.type == "cpu" and model_loading.cpu_has_native_bf16()
        self.runner: RunnerChoice
        engine, self.runner = choose_detector_runner(
            settings.archive_runners, model_dir, MachineTarget.here(device, self.precision),
            native_bf16, self.network, timeout_s, torch.get_num_threads())
        self.run: Any = self.network if engine is None else SsdEngineDetector(self.network, engine)

    def model_input(self, images: Sequence[torch.Tensor],
                    options: Sequence[DetectionOptions] | None = None) -> DetectorInput:
        """`uint8[3, H_i, W_i]` images -> the network's input (and letterbox geometry); with the
        requests' `options`, the network keeps only candidates some request can be answered
        (`handlers.task.detection.candidate_score_threshold`), without them every candidate."""
        return self.format.model_input(images, self.device, lowest_score_asked(options))

    def forward(self, model_input: DetectorInput) -> Any:
        precision = self.precision if self.runner.computes_in_torch else "fp32"
        with self._running, autocast(self.device, precision), \
                self.format.running_batch(self.network, model_input):
            return self.format.model_output(self.run(model_input.images))

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
