"""One detection network ready to serve on a device: its settings, class names, precision,
output format (torchvision detector or YOLO-style; see `handlers.model.detector_formats`) and
runner: an SSD-family detector whose archive has its backbone and head for OpenVINO or ONNX
Runtime runs them there when one passes its check (handlers.model.runner_selection), else the
eager network serves; an Ultralytics export whose archive has its OpenVINO model runs that when it
passes its check (handlers.model.ultralytics_engine), else the export itself.

Used by the object detector and by the detect-then-classify pipeline.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from handlers.ground.kind_options import DetectionOptions
from handlers.ground.limits import SettingsError
from handlers.model import model_loading
from handlers.model.compiled_model import MachineTarget
from handlers.model.detector_formats import BatchedSsdFormat, DetectorFormat, detector_format
from handlers.model.model_loading import autocast, load_for_serving
from handlers.model.runner_selection import RunnerChoice, choose_detector_runner, choose_ultralytics_runner
from handlers.model.settings import DetectorSettings
from handlers.model.ssd_engine import NotAnSsdDetector, SsdBackboneHead, SsdEngineDetector, ssd_input_size_hw
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
        self.format: DetectorFormat = detector_format(settings.output_format, settings.input_hw,
                                                      settings.letterbox_fill, settings.end_to_end)
        self._running = threading.Lock()    # a batch's settings of the network hold for its forward
        timeout_s = settings.compile.load_timeout_s if settings.compile else 0.0
        native_bf16 = device.type == "cpu" and model_loading.cpu_has_native_bf16()
        self.runner: RunnerChoice
        machine = MachineTarget.here(device, self.precision)
        self.run: Any
        if settings.output_format == "ultralytics":
            export_engine, self.runner = choose_ultralytics_runner(
                settings.archive_runners, model_dir, machine, native_bf16, self.network, timeout_s,
                torch.get_num_threads())
            self.run = self.network if export_engine is None else export_engine
            return
        engine, self.runner = choose_detector_runner(
            settings.archive_runners, model_dir, machine, native_bf16, self.network, timeout_s,
            torch.get_num_threads(), settings.solo_threads)
        self.run = self.network if engine is None else SsdEngineDetector(self.network, engine)
        if postprocesses_batched(settings, device, self.network):
            self.format = BatchedSsdFormat(self.network)
            self.run = SsdBackboneHead(self.network) if engine is None else engine

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

    @property
    def postprocess(self) -> str:
        """"batched" (handlers.task.ssd_postprocess) or "per-image" (the network's own)."""
        return "batched" if isinstance(self.format, BatchedSsdFormat) else "per-image"

    def warm_up(self, batch_size: int) -> None:
        """Batch 1 and `batch_size`, from the network's input to each image's detections at the
        archive's default options (the batched postprocess runs apart from the network)."""
        image = torch.zeros(3, *WARM_UP_SIZE_HW, dtype=torch.uint8, device=self.device)
        with torch.inference_mode():
            for count in sorted({1, batch_size}):
                images = [image] * count
                options = [self.settings.defaults] * count
                model_input = self.model_input(images, options)
                self.detections(self.forward(model_input), model_input, images, options)


def postprocesses_batched(settings: DetectorSettings, device: torch.device, network: Any) -> bool:
    """Whether the batch's postprocess is handlers.task.ssd_postprocess's: for a torchvision
    SSD-family detector, as `detection.postprocess` says, `auto` on a GPU (a fixed number of
    synchronisations per batch) and not on a CPU (torchvision's loop is the faster there)."""
    if settings.output_format != "torchvision" or settings.postprocess == "per-image":
        return False
    try:
        ssd_input_size_hw(network)
    except NotAnSsdDetector:
        if settings.postprocess == "batched":
            raise SettingsError("'detection.postprocess: batched' applies to SSD-family detectors "
                                "(SSD300, SSDlite)") from None
        return False
    return settings.postprocess == "batched" or device.type == "cuda"
