"""The two kinds of detector output, each a strategy chosen once when a worker loads its model.

- `TorchvisionFormat`: torchvision detectors (Faster R-CNN, RetinaNet, FCOS, SSD, SSDlite) take a
  list of float images of any sizes and return boxes in each image's own pixels.
- `BatchedSsdFormat`: the SSD family of those (SSD300, SSDlite) with the batch at once: the
  network's transform as one normalization and resize per image size, its backbone and head on
  the batch, and handlers.task.ssd_postprocess's postprocess and per-request selection, with the
  same answers; the host waits a fixed number of times per batch (a GPU worker's choice).
- `YoloFormat`: single-tensor models (`[B, 4 + C, N]`: cx, cy, w, h in input pixels, then C class
  scores) take a letterboxed square batch; candidates are decoded, NMS'd per class on the device
  and mapped back through each image's recorded letterbox.
- `UltralyticsFormat`: an Ultralytics detection export (the same output) prepared and
  postprocessed as Ultralytics' own `predict` does: its letterbox with OpenCV's bilinear resize,
  its NMS (handlers.task.ultralytics_nms), its mapping of boxes back.

Both select per request in the same place (`detections`): score threshold, classes, cap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torchvision.ops import clip_boxes_to_image
from torchvision.transforms.v2 import functional as F

from handlers.ground.kind_options import DetectionOptions
from handlers.model.ssd_engine import image_anchors_xyxy, ssd_input_batch, ssd_input_size_hw
from handlers.task.detection import (
    DetectionTensors,
    DetectorInput,
    candidate_score_threshold,
    select_detections,
    suppress_overlaps,
    yolo_candidates,
)
from handlers.task.letterbox import boxes_to_original, letterbox_batch, ultralytics_letterbox_batch
from handlers.task.ssd_postprocess import RequestSelection, SsdPostprocessSettings, batched_ssd_detections
from handlers.task.ultralytics_nms import ultralytics_detections, ultralytics_end_to_end_detections


class DetectorFormat(Protocol):
    def model_input(self, images: Sequence[torch.Tensor], device: torch.device,
                    lowest_score_asked: float | None) -> DetectorInput:
        """`uint8[3, H, W]` images -> the model's input (and the geometry to map boxes back)."""

    def running_batch(self, network: Any,
                      model_input: DetectorInput) -> contextlib.AbstractContextManager[None]:
        """What the network is set to while it runs this batch."""

    def model_output(self, output: Any) -> Any:
        """What the model returned -> one entry per image."""

    def detections(self, output: Any, model_input: DetectorInput,
                   images: Sequence[torch.Tensor],
                   options: Sequence[DetectionOptions]) -> list[DetectionTensors]:
        """Each image's selected detections, boxes in its own pixels, best first."""


class TorchvisionFormat:
    def model_input(self, images: Sequence[torch.Tensor], device: torch.device,
                    lowest_score_asked: float | None) -> DetectorInput:
        return DetectorInput([F.to_dtype(image.to(device), torch.float32, scale=True) for image in images],
                             lowest_score_asked=lowest_score_asked)

    def running_batch(self, network: Any,
                      model_input: DetectorInput) -> contextlib.AbstractContextManager[None]:
        return candidates_from(network, model_input.lowest_score_asked)

    def model_output(self, output: Any) -> Any:
        return output

    def detections(self, output: Sequence[Mapping[str, torch.Tensor]], model_input: DetectorInput,
                   images: Sequence[torch.Tensor],
                   options: Sequence[DetectionOptions]) -> list[DetectionTensors]:
        selected = []
        for found, image, asked in zip(output, images, options, strict=True):
            boxes = clip_boxes_to_image(found["boxes"], (image.shape[-2], image.shape[-1]))
            selected.append(select_detections(DetectionTensors(boxes, found["scores"], found["labels"]),
                                              asked))
        return selected


class BatchedSsdFormat:
    """For a torchvision SSD-family `network` whose backbone and head the caller runs on the batch
    (`float[B, 3, S, S]` -> box regression, class logits)."""

    def __init__(self, network: Any) -> None:
        self.network = network
        self.input_size_hw = ssd_input_size_hw(network)
        self.anchors_xyxy = image_anchors_xyxy(network)
        self.settings = SsdPostprocessSettings.of(network)
        self.model_threshold = float(network.score_thresh)

    def model_input(self, images: Sequence[torch.Tensor], device: torch.device,
                    lowest_score_asked: float | None) -> DetectorInput:
        sizes_hw = [(int(image.shape[-2]), int(image.shape[-1])) for image in images]
        return DetectorInput(ssd_input_batch(self.network, images, device),
                             lowest_score_asked=lowest_score_asked, original_sizes_hw=sizes_hw)

    def running_batch(self, network: Any,
                      model_input: DetectorInput) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()    # the candidates' threshold is the postprocess's argument

    def model_output(self, output: Any) -> Any:
        return output

    def detections(self, output: Sequence[torch.Tensor], model_input: DetectorInput,
                   images: Sequence[torch.Tensor],
                   options: Sequence[DetectionOptions]) -> list[DetectionTensors]:
        """Each image's detections as host tensors, read from the device in one copy."""
        assert model_input.original_sizes_hw is not None
        regression, logits = (tensor.to(self.anchors_xyxy.device) for tensor in output)
        found = batched_ssd_detections(
            regression, logits, self.anchors_xyxy, self.input_size_hw, model_input.original_sizes_hw,
            self.settings, candidate_score_threshold(self.model_threshold, model_input.lowest_score_asked),
            [RequestSelection(asked.score_threshold, asked.classes, asked.max_detections)
             for asked in options])
        # boxes, score, label, selected per row (labels and flags are exact in float32): one copy
        packed = torch.cat([found.boxes_xyxy, found.scores.unsqueeze(-1),
                            found.labels.unsqueeze(-1).float(), found.selected.unsqueeze(-1).float()],
                           dim=-1).cpu()
        return [selected_rows(rows) for rows in packed]


def selected_rows(rows: torch.Tensor) -> DetectionTensors:
    """One image's packed host rows `float[N, 7]` (box, score, label, selected) -> its detections."""
    chosen = rows[:, 6] > 0
    return DetectionTensors(rows[chosen, :4], rows[chosen, 4], rows[chosen, 5].long())


@dataclass(frozen=True)
class YoloFormat:
    input_size: int
    letterbox_fill: int

    def model_input(self, images: Sequence[torch.Tensor], device: torch.device,
                    lowest_score_asked: float | None) -> DetectorInput:
        batch, letterboxes = letterbox_batch(images, self.input_size, self.letterbox_fill, device)
        return DetectorInput(batch, letterboxes, lowest_score_asked)

    def running_batch(self, network: Any,
                      model_input: DetectorInput) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()    # candidates are thresholded per request, before NMS

    def model_output(self, output: Any) -> Any:
        return output[0] if isinstance(output, (tuple, list)) else output  # (predictions, extras)

    def detections(self, output: torch.Tensor, model_input: DetectorInput,
                   images: Sequence[torch.Tensor],
                   options: Sequence[DetectionOptions]) -> list[DetectionTensors]:
        assert model_input.letterboxes is not None
        selected = []
        for raw, letterbox, asked in zip(output, model_input.letterboxes, options, strict=True):
            found = yolo_detections(raw, asked)
            selected.append(found._replace(boxes_xyxy=boxes_to_original(found.boxes_xyxy, letterbox)))
        return selected


@dataclass(frozen=True)
class UltralyticsFormat:
    input_hw: tuple[int, int]
    letterbox_fill: int
    end_to_end: bool = False      # the export answers its detections (`[B, N, 6]`): no NMS here

    def model_input(self, images: Sequence[torch.Tensor], device: torch.device,
                    lowest_score_asked: float | None) -> DetectorInput:
        batch, letterboxes = ultralytics_letterbox_batch(images, self.input_hw, self.letterbox_fill, device)
        return DetectorInput(batch, letterboxes, lowest_score_asked)

    def running_batch(self, network: Any,
                      model_input: DetectorInput) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()    # candidates are thresholded per request, before NMS

    def model_output(self, output: Any) -> Any:
        return output[0] if isinstance(output, (tuple, list)) else output

    def detections(self, output: torch.Tensor, model_input: DetectorInput,
                   images: Sequence[torch.Tensor],
                   options: Sequence[DetectionOptions]) -> list[DetectionTensors]:
        assert model_input.letterboxes is not None
        selected = []
        select = ultralytics_end_to_end_detections if self.end_to_end else ultralytics_detections
        for raw, letterbox, asked in zip(output, model_input.letterboxes, options, strict=True):
            found = select(raw, asked)
            selected.append(found._replace(boxes_xyxy=boxes_to_original(found.boxes_xyxy, letterbox)))
        return selected


def postprocess_settings(network: Any) -> Any | None:
    """The module whose `score_thresh` a torchvision detector's postprocess reads (`roi_heads` for
    the R-CNNs, the model itself for SSD, RetinaNet and FCOS); None for anything else."""
    holder = getattr(network, "roi_heads", network)
    return holder if isinstance(getattr(holder, "score_thresh", None), float) else None


@contextlib.contextmanager
def candidates_from(network: Any, lowest_score_asked: float | None) -> Iterator[None]:
    """Run the network with its postprocess dropping the candidates no request of the batch can
    be answered (`candidate_score_threshold`), then put its threshold back. The served threshold
    is the lowest a request may ask for (0.001 by default), where per-class top-k and NMS over
    every candidate are most of an SSDlite forward pass on a CPU (docs/benchmarks.md)."""
    holder = postprocess_settings(network)
    if holder is None:
        yield
        return
    configured = holder.score_thresh
    holder.score_thresh = candidate_score_threshold(configured, lowest_score_asked)
    try:
        yield
    finally:
        holder.score_thresh = configured


def yolo_detections(raw: torch.Tensor, options: DetectionOptions) -> DetectionTensors:
    """One image's `float[4 + C, N]` output -> its detections in input pixels, best first:
    thresholds and the class filter before NMS (as Ultralytics does), the cap after it."""
    candidates = yolo_candidates(raw)
    unlimited = replace(options, max_detections=candidates.scores.shape[0])
    return suppress_overlaps(select_detections(candidates, unlimited), options.iou_threshold,
                             options.max_detections, options.agnostic_nms)


def detector_format(output: str, input_hw: tuple[int, int], letterbox_fill: int,
                    end_to_end: bool = False) -> DetectorFormat:
    """The strategy for a `detection.output` setting (the generic YOLO path's input is square:
    its height)."""
    if output == "ultralytics":
        return UltralyticsFormat(input_hw, letterbox_fill, end_to_end)
    return YoloFormat(input_hw[0], letterbox_fill) if output == "yolo" else TorchvisionFormat()
