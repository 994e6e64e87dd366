"""A torchvision SSD-family detector (SSD300, SSDlite) with its backbone and head on another
engine: the archive builder exports `SsdBackboneHead` to OpenVINO and ONNX, and a worker that
loads one (handlers.model.runner_selection.choose_detector_runner) serves `SsdEngineDetector`,
which keeps the rest in torch: the transform (resize to the fixed input, normalize), the anchors
(the same for every image: computed once) and the postprocess (box decoding, the score
threshold the batch's requests need, per-class NMS: handlers.model.detector_formats).

Other torchvision detectors (the R-CNNs, RetinaNet, FCOS) take images of any size or run a
region stage between backbone and head; they serve eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn
from torchvision.models.detection.image_list import ImageList
from torchvision.transforms.v2 import functional as F

from handlers.model.answer_agreement import probability_bound
from handlers.task.ssd_postprocess import ScoreActivation, class_scores

SSD_OUTPUT_NAMES = ("bbox_regression", "cls_logits")
# `float[B, 3, S, S]` normalized batch -> (box regression `float[B, A, 4]`, class logits
# `float[B, A, C]`), A anchors per image.
HeadOutputs = tuple[torch.Tensor, torch.Tensor]
BackboneHeadRunner = Callable[[torch.Tensor], Sequence[torch.Tensor]]


class NotAnSsdDetector(ValueError):
    """The network is not a torchvision SSD-family detector with a fixed input size."""


def ssd_input_size_hw(network: Any) -> tuple[int, int]:
    """The fixed (height, width) an SSD-family detector's transform resizes every image to;
    NotAnSsdDetector for any other network. (torchvision keeps it as `fixed_size`, (width,
    height), and resizes to `[fixed_size[1], fixed_size[0]]`.)"""
    parts = ("transform", "backbone", "head", "anchor_generator", "postprocess_detections", "box_coder")
    fixed = getattr(getattr(network, "transform", None), "fixed_size", None)
    if not all(hasattr(network, part) for part in parts) or fixed is None:
        raise NotAnSsdDetector(f"{type(network).__name__} is not a torchvision SSD-family detector "
                               "with a fixed input size (SSD300, SSDlite)")
    return int(fixed[1]), int(fixed[0])


class SsdBackboneHead(nn.Module):
    """An SSD's backbone and head: `float[B, 3, S, S]` (after its transform) -> HeadOutputs."""

    def __init__(self, detector: Any) -> None:
        super().__init__()
        self.backbone, self.head = detector.backbone, detector.head

    def forward(self, images: torch.Tensor) -> HeadOutputs:
        output = self.head(feature_maps(self.backbone, images))
        return output["bbox_regression"], output["cls_logits"]


def feature_maps(backbone: Any, images: torch.Tensor) -> list[torch.Tensor]:
    """The backbone's feature maps as the SSD head and anchor generator take them (a list)."""
    features = backbone(images)
    return [features] if isinstance(features, torch.Tensor) else list(features.values())


def image_anchors_xyxy(network: Any) -> torch.Tensor:
    """`float[A, 4]`: the anchors of one image at the fixed input size, in its pixels (the
    same for every image of a batch). Runs the eager backbone once, for its feature sizes."""
    height, width = ssd_input_size_hw(network)
    images = torch.zeros(1, 3, height, width, device=next(network.parameters()).device)
    with torch.inference_mode():
        features = feature_maps(network.backbone, images)
        return network.anchor_generator(ImageList(images, [(height, width)]), features)[0]


def ssd_input_batch(network: Any, images: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """uint8 `[3, H_i, W_i]` images -> the network's normalized `float[B, 3, S, S]` batch, as its
    transform makes it from the float images (`transformed_batch`), bit for bit, with one
    normalization and one resize per distinct size instead of one per image: the transform's
    own `uint8_batch` where it has one (handlers.model.tf_ssd_mobilenet: resize, then
    normalize), else as torchvision's transforms do (normalize, then torchvision's bilinear
    resize without antialiasing)."""
    height, width = ssd_input_size_hw(network)
    mean, std = ssd_normalization(tuple(network.transform.image_mean), tuple(network.transform.image_std),
                                  device)
    uint8_batch = getattr(network.transform, "uint8_batch", None)
    by_size: dict[tuple[int, int], list[int]] = {}
    for index, image in enumerate(images):
        by_size.setdefault((image.shape[-2], image.shape[-1]), []).append(index)
    parts: list[tuple[list[int], torch.Tensor]] = []
    for indices in by_size.values():
        same_size = torch.stack([images[index].to(device, non_blocking=True) for index in indices])
        if uint8_batch is not None:
            parts.append((indices, uint8_batch(same_size)))
            continue
        scaled = F.to_dtype(same_size, torch.float32, scale=True)
        parts.append((indices, nn.functional.interpolate((scaled - mean) / std, size=[height, width],
                                                         mode="bilinear", align_corners=False)))
    if len(parts) == 1:
        return parts[0][1]
    batch = torch.empty((len(images), 3, height, width), dtype=torch.float32, device=device)
    for indices, resized in parts:
        batch[indices] = resized
    return batch


@lru_cache(maxsize=8)
def ssd_normalization(mean: tuple[float, ...], std: tuple[float, ...],
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[C, 1, 1]` mean and std on `device`, made once."""
    return (torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1).to(device),
            torch.tensor(std, dtype=torch.float32).view(-1, 1, 1).to(device))


def transformed_batch(network: Any, images: Sequence[torch.Tensor]) -> ImageList:
    """float `[3, H_i, W_i]` images in [0, 1] -> the network's normalized `[B, 3, S, S]` batch."""
    image_list, _ = network.transform(list(images))
    return image_list


class SsdEngineDetector:
    """Called as the eager detector in eval mode is (float `[3, H_i, W_i]` images in [0, 1] ->
    per image `{"boxes", "scores", "labels"}` in its own pixels), with the backbone and head on
    `engine`. The postprocess reads the network's settings (its `score_thresh` too) at each call."""

    def __init__(self, network: Any, engine: BackboneHeadRunner) -> None:
        self.network = network
        self.engine = engine
        self.anchors_xyxy = image_anchors_xyxy(network)

    def __call__(self, images: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        original_sizes_hw = [(int(image.shape[-2]), int(image.shape[-1])) for image in images]
        batch = transformed_batch(self.network, images)
        regression, logits = self.engine(batch.tensors)
        head = {"bbox_regression": regression.to(self.anchors_xyxy.device),
                "cls_logits": logits.to(self.anchors_xyxy.device)}
        found = self.network.postprocess_detections(head, [self.anchors_xyxy] * len(images),
                                                    batch.image_sizes)
        result: list[dict[str, torch.Tensor]] = self.network.transform.postprocess(
            found, batch.image_sizes, original_sizes_hw)
        return result


def head_output_disagreement(got: Sequence[torch.Tensor], expected: HeadOutputs,
                             anchors_xyxy: torch.Tensor, box_coder: Any, bound: float,
                             activation: ScoreActivation = "softmax",
                             lowest_score: float = 0.0) -> str | None:
    """Why an engine's head outputs for a batch are not the eager fp32 network's `expected` ones
    computed with rounding of at most `bound` (answer_agreement.probability_bound), or None.

    Compared where an answer can come from: the (anchor, object class) pairs whose score (the
    softmax of the anchor's logits, or their sigmoids for a network whose `score_activation` says
    so) is at least `lowest_score` on either side (the network's `score_thresh`, the lowest score
    a request may ask for; the background, class 0, is never answered). Each such score moves by
    at most `bound`, and the decoded box of each anchor with such a pair moves its sides by at
    most `bound` of the anchor's own width or height. Per anchor, before the score threshold and
    NMS, where a tiny rounding difference can change which of two near-equal boxes is kept. A
    non-finite output never agrees."""
    if len(got) != 2 or any(g.shape != e.shape for g, e in zip(got, expected, strict=False)):
        return f"output shapes {[tuple(g.shape) for g in got]}, eager {[tuple(e.shape) for e in expected]}"
    (regression, logits), (expected_regression, expected_logits) = got, expected
    if not (bool(torch.isfinite(regression).all()) and bool(torch.isfinite(logits).all())):
        return "a head output is not finite"
    scores = class_scores(logits.float(), activation)[..., 1:]
    expected_scores = class_scores(expected_logits.float(), activation)[..., 1:]
    answerable = (scores >= lowest_score) | (expected_scores >= lowest_score)     # [B, A, C - 1]
    score_shift = (scores - expected_scores).abs().masked_fill(~answerable, 0.0).amax()
    if not score_shift <= bound:
        return f"a class score moved by {float(score_shift):.3g} (+-{bound:g})"
    anchor_wh = (anchors_xyxy[:, 2:] - anchors_xyxy[:, :2]).repeat(1, 2)
    for image, (ours, theirs, answered) in enumerate(zip(regression.float(), expected_regression.float(),
                                                         answerable.any(dim=-1), strict=True)):
        shift = ((box_coder.decode_single(ours, anchors_xyxy)
                  - box_coder.decode_single(theirs, anchors_xyxy)).abs() / anchor_wh)[answered]
        if shift.numel() and not shift.amax() <= bound:
            return (f"image {image}: a box side moved by {float(shift.amax()):.3g} of its anchor's "
                    f"size (+-{bound:g})")
    return None


@dataclass(frozen=True)
class ProbeHeadReference:
    """The eager fp32 network on the archive's probe photos: `batch`, the photos as its head's
    input (after its transform), `expected`, its head outputs for them, and `anchors_xyxy`, one
    image's anchors. A worker computes it once, however many engine loads it checks."""

    batch: torch.Tensor
    expected: HeadOutputs
    anchors_xyxy: torch.Tensor


def probe_head_reference(network: Any, probe: torch.Tensor) -> ProbeHeadReference:
    """`network`'s ProbeHeadReference for the `uint8[N, 3, S, S]` probe photos."""
    with torch.inference_mode():
        batch = transformed_batch(network, [photo.float() / 255 for photo in probe]).tensors
        return ProbeHeadReference(batch, SsdBackboneHead(network)(batch), image_anchors_xyxy(network))


def check_head_outputs(engine: BackboneHeadRunner, network: Any, reference: ProbeHeadReference,
                       *precisions: str) -> str | None:
    """Why `engine`'s answers to the probe photos are not the eager fp32 network's (`reference`:
    head_output_disagreement, at the loosest bound of `precisions`), or None. An engine that fails
    to run them raises."""
    with torch.inference_mode():
        got = engine(reference.batch)
    return head_output_disagreement(got, reference.expected, reference.anchors_xyxy, network.box_coder,
                                    probability_bound(*precisions),
                                    getattr(network, "score_activation", "softmax"),
                                    float(network.score_thresh))
