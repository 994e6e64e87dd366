"""An SSD-family detector's postprocess for a whole batch at once, with the answers torchvision's
gives image by image: `SSD.postprocess_detections` (box decoding, per-class score threshold and
top-k, per-class NMS, the detections-per-image cap), `GeneralizedRCNNTransform.postprocess` (boxes
back to each image's size), then this project's clip and per-request selection
(handlers.task.detection.select_detections). The same detections in the same order, the same
labels, scores and boxes bit for bit, wherever no two candidates tie in score (below).

torchvision loops over images and classes, and each class's boolean mask, top-k and NMS stop a
GPU's host (about 5,900 synchronisations for 16 images at score 0.001). Here every step is one
tensor operation over the batch: the top-k of every (image, class) by one sort, NMS by
Cluster-NMS (the greedy result as the fixed point of "a candidate is kept when no kept, better
candidate of its class overlaps it"), on the IoU of every pair of one class's candidates in
chunks, only for the (image, class) pairs that have a candidate, and each request's selection by
masks. The host waits a fixed number of times per batch: once for the longest class's candidate
count (the IoU matrices' side) with the number of pairs that have one, once
per `CONVERGENCE_CHECK_EVERY` NMS rounds (one check where NMS settles within that many rounds,
as on every photo measured), and for the answers' one copy.

An SSD whose class scores are sigmoids (TensorFlow's SSDs: handlers.model.tf_ssd_mobilenet, whose
own per-image postprocess this matches in the same way) gets sigmoid scores, and its candidates
whose clipped box has no area are dropped before NMS, as that network's postprocess does.

Arithmetic as torchvision's, operation for operation: softmax; `BoxCoder.decode_single`; clip to
the network's input; IoU as torchvision's CPU NMS kernel computes it (float32 intersection and
areas, compared with the threshold in double), on the coordinates its `batched_nms` uses: shifted
by `class * (largest coordinate + 1)` for an image of up to `coordinate_trick_boxes` candidates,
as they are; the ratio of sizes and the multiplication that scale boxes back.

Exact score ties: here the candidates of a class are ordered by score, then by anchor index; the
kept detections of an image by score, then class, then that order. torchvision orders ties as
its sort and top-k kernels happen to (neither is stable), so where two candidates tie, the two
postprocesses may order them differently, and where tied candidates overlap, keep a different one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchvision.ops import clip_boxes_to_image

CONVERGENCE_CHECK_EVERY = 16     # 10 rounds settled 32 distinct photos at score 0.001
# torchvision's batched_nms shifts boxes per class (its "coordinate trick") up to this many
# candidates per image (4000 / 4 coordinates on the CPU, 100,000 / 4 on a GPU), and runs NMS
# class by class above it.
COORDINATE_TRICK_BOXES = {"cpu": 1000, "cuda": 25000}
IOU_CHUNK_ELEMENTS = 1 << 25       # IoU entries computed at once (128 MiB of float32)


ScoreActivation = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class SsdPostprocessSettings:
    """What torchvision's SSD postprocess reads of the network (`score_thresh` is per batch:
    the lowest a request of the batch asks for, handlers.task.detection.candidate_score_threshold),
    and how its scores are made: softmax over the classes (torchvision's SSDs), or each class's
    sigmoid with empty boxes dropped (a network whose `score_activation` says "sigmoid")."""

    topk_candidates: int
    nms_threshold: float
    detections_per_image: int
    box_coder: Any                   # torchvision's BoxCoder of the network
    score_activation: ScoreActivation = "softmax"

    @classmethod
    def of(cls, network: Any) -> SsdPostprocessSettings:
        return cls(int(network.topk_candidates), float(network.nms_thresh),
                   int(network.detections_per_img), network.box_coder,
                   getattr(network, "score_activation", "softmax"))

    @property
    def drops_empty_boxes(self) -> bool:
        return self.score_activation == "sigmoid"


def class_scores(logits: torch.Tensor, activation: ScoreActivation) -> torch.Tensor:
    """Class logits `float[..., C]` -> the scores a detection is given."""
    return torch.sigmoid(logits) if activation == "sigmoid" else torch.softmax(logits, dim=-1)


@dataclass(frozen=True)
class RequestSelection:
    """One image's request: scores >= `score_threshold`, of `classes` (None: all), at most
    `max_detections`."""

    score_threshold: float
    classes: frozenset[int] | None
    max_detections: int


@dataclass(frozen=True)
class BatchDetections:
    """Each image's selected detections, best first, padded to one length: boxes `float[B, N, 4]`
    xyxy in the image's own pixels, scores `float[B, N]`, labels `int64[B, N]`, and `selected`
    `bool[B, N]`, true for the image's first `count` entries."""

    boxes_xyxy: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    selected: torch.Tensor


def batched_ssd_detections(regression: torch.Tensor, logits: torch.Tensor, anchors_xyxy: torch.Tensor,
                           input_size_hw: tuple[int, int], original_sizes_hw: Sequence[tuple[int, int]],
                           settings: SsdPostprocessSettings, score_threshold: float,
                           requests: Sequence[RequestSelection]) -> BatchDetections:
    """`float[B, A, 4]` box regression and `float[B, A, C]` class logits of a batch resized to
    `input_size_hw`, with the anchors `float[A, 4]` of one image -> each image's detections
    under its request, in its original size. `score_threshold`: the candidates' (the network's
    `score_thresh` for this batch)."""
    boxes, scores = decoded_candidates(regression, logits, anchors_xyxy, input_size_hw, settings)
    has_area = ((boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1])
                if settings.drops_empty_boxes else None)
    order, top_scores, valid, present = top_candidates(scores, score_threshold, settings.topk_candidates,
                                                       has_area)
    top_boxes = torch.gather(boxes.unsqueeze(1).expand(-1, order.shape[1], -1, -1), 2,
                             order.unsqueeze(-1).expand(-1, -1, -1, 4))
    kept = suppressed_by_class(top_boxes, valid, settings.nms_threshold,
                               COORDINATE_TRICK_BOXES.get(boxes.device.type, COORDINATE_TRICK_BOXES["cuda"]),
                               present)
    return selected_detections(top_boxes, top_scores, kept, input_size_hw, original_sizes_hw, settings,
                               requests)


def decoded_candidates(regression: torch.Tensor, logits: torch.Tensor, anchors_xyxy: torch.Tensor,
                       input_size_hw: tuple[int, int],
                       settings: SsdPostprocessSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Boxes `float[B, A, 4]` decoded and clipped to the input, and class scores `float[B, A, C]`,
    each as `postprocess_detections` computes them for one image."""
    batch, anchors = regression.shape[:2]
    scores = class_scores(logits, settings.score_activation)
    decoded = settings.box_coder.decode_single(regression.reshape(batch * anchors, 4),
                                               anchors_xyxy.repeat(batch, 1))
    return clip_boxes_to_image(decoded.reshape(batch, anchors, 4), input_size_hw), scores


def top_candidates(scores: torch.Tensor, score_threshold: float, topk: int,
                   has_area: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Per image and class (the background, class 0, left out): the anchors of the `topk` best
    scores above `score_threshold`, best first (ties by anchor index): anchor indices
    `int64[B, C - 1, k]`, their scores `float[B, C - 1, k]`, `valid` `bool[B, C - 1, k]`
    (false past a class's candidates), and how many (image, class) pairs have a candidate. k is
    `topk`, or fewer when every class has fewer candidates (one synchronisation: the longest
    class's count and the pairs read together). `has_area` `bool[B, A]`: only these anchors are
    candidates (None: all)."""
    by_class = scores[:, :, 1:].transpose(1, 2)
    passing = by_class > score_threshold
    if has_area is not None:
        passing &= has_area.unsqueeze(1)
    longest, present = 0, 0
    if passing.numel():
        counts = passing.sum(dim=-1)
        longest, present = (int(value) for value in torch.stack([counts.max(), (counts > 0).sum()]).tolist())
    k = max(1, min(topk, longest))
    ranked = by_class.masked_fill(~passing, float("-inf"))
    top_scores, order = torch.sort(ranked, dim=-1, descending=True, stable=True)
    top_scores, order = top_scores[..., :k], order[..., :k]
    return order, top_scores, top_scores > float("-inf"), present


def suppressed_by_class(boxes: torch.Tensor, valid: torch.Tensor, iou_threshold: float,
                        coordinate_trick_boxes: int, present: int) -> torch.Tensor:
    """Greedy NMS of each (image, class)'s candidates `float[B, K, k, 4]`, best first, as
    torchvision's `batched_nms` over an image's candidates: `bool[B, K, k]`, true where kept.
    Only the `present` (image, class) pairs that have a candidate are computed, gathered in
    front by a stable sort on the device (at a request threshold of 0.3 a few classes of an
    image's 90 have one, so the IoU matrices are a few per image, not one per class)."""
    batch, classes, k, _ = boxes.shape
    # each image's coordinates as its batched_nms sees them: shifted per class up to
    # coordinate_trick_boxes candidates, as they are above it
    trick = (valid.sum(dim=(1, 2)) <= coordinate_trick_boxes).view(batch, 1, 1, 1)
    coordinates = torch.where(trick, nms_coordinates(boxes, valid), boxes).reshape(batch * classes, k, 4)
    by_pair = valid.reshape(batch * classes, k)
    kept = torch.zeros_like(by_pair)
    if present == 0:
        return kept.reshape(batch, classes, k)
    pairs = torch.argsort((~by_pair[:, 0]).to(torch.uint8), stable=True)[:present]
    pair_valid = by_pair.index_select(0, pairs)
    pair_coordinates = coordinates.index_select(0, pairs)
    chunk = max(1, IOU_CHUNK_ELEMENTS // (k * k))
    overlaps = [pairwise_iou_exceeds(pair_coordinates[start:start + chunk], iou_threshold)
                for start in range(0, present, chunk)]
    later = torch.ones(k, k, dtype=torch.bool, device=boxes.device).triu(diagonal=1)
    suppresses = torch.cat(overlaps) & later & pair_valid.unsqueeze(-1) & pair_valid.unsqueeze(-2)
    kept.index_copy_(0, pairs, cluster_nms(suppresses, pair_valid))
    return kept.reshape(batch, classes, k)


def nms_coordinates(boxes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The candidates shifted as `batched_nms`'s coordinate trick shifts them: class `c` (1-based)
    by `c * (largest coordinate of the image's candidates + 1)`, in float32."""
    batch, classes = boxes.shape[:2]
    present = boxes.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    largest = present.reshape(batch, -1).amax(dim=1)
    labels = torch.arange(1, classes + 1, device=boxes.device, dtype=boxes.dtype)
    offsets = labels.view(1, classes) * (largest.view(batch, 1) + torch.ones((), dtype=boxes.dtype,
                                                                            device=boxes.device))
    return boxes + offsets.view(batch, classes, 1, 1)


def pairwise_iou_exceeds(boxes: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """`bool[..., k, k]`: IoU of candidates i and j over `iou_threshold`, computed as
    torchvision's CPU NMS kernel does (float32; the ratio compared in double)."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    areas = (x2 - x1) * (y2 - y1)
    width = (torch.minimum(x2.unsqueeze(-1), x2.unsqueeze(-2))
             - torch.maximum(x1.unsqueeze(-1), x1.unsqueeze(-2))).clamp(min=0)
    height = (torch.minimum(y2.unsqueeze(-1), y2.unsqueeze(-2))
              - torch.maximum(y1.unsqueeze(-1), y1.unsqueeze(-2))).clamp(min=0)
    inter = width * height
    ratio = inter / (areas.unsqueeze(-1) + areas.unsqueeze(-2) - inter)
    return ratio.double() > iou_threshold


def cluster_nms(suppresses: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The greedy NMS result from `suppresses[..., i, j]` (i is better than j and overlaps it):
    iterate "j is kept when valid and no kept i suppresses it" to its fixed point, which is the
    greedy result (reached within k rounds: after round r the first r candidates are settled).
    Rounds run in blocks of CONVERGENCE_CHECK_EVERY, each block followed by one check that its
    last round changed nothing (one check, whatever the batch, where NMS settles within a block)."""
    kept = valid
    rounds = suppresses.shape[-1]
    done = 0
    while True:
        for _ in range(CONVERGENCE_CHECK_EVERY):
            previous, kept = kept, valid & ~(suppresses & kept.unsqueeze(-1)).any(dim=-2)
        done += CONVERGENCE_CHECK_EVERY
        if bool(torch.equal(previous, kept)) or done >= rounds:
            return kept


def selected_detections(boxes: torch.Tensor, scores: torch.Tensor, kept: torch.Tensor,
                        input_size_hw: tuple[int, int], original_sizes_hw: Sequence[tuple[int, int]],
                        settings: SsdPostprocessSettings,
                        requests: Sequence[RequestSelection]) -> BatchDetections:
    """The kept candidates of each image, best first (score, then class, then rank in class),
    the image's first `detections_per_image`, scaled back to its size and clipped to it, then its
    request's selection."""
    batch, classes, k = scores.shape
    device = scores.device
    flat_scores = scores.masked_fill(~kept, float("-inf")).reshape(batch, classes * k)
    ranked, order = torch.sort(flat_scores, dim=1, descending=True, stable=True)
    length = min(settings.detections_per_image, classes * k)
    ranked, order = ranked[:, :length], order[:, :length]
    present = ranked > float("-inf")
    boxes = torch.gather(boxes.reshape(batch, classes * k, 4), 1, order.unsqueeze(-1).expand(-1, -1, 4))
    labels = order // k + 1
    asked = request_table(requests, original_sizes_hw, classes, device)
    sizes = asked[:, :2]
    scaled = scaled_boxes(boxes, sizes, input_size_hw)
    clipped = torch.stack([clip_axis(scaled[..., 0::2], sizes[:, 1]),
                           clip_axis(scaled[..., 1::2], sizes[:, 0])], dim=-1)
    clipped = clipped.reshape(batch, length, 4)
    wanted = torch.gather(asked[:, 4:] > 0, 1, labels)
    selected = present & (ranked >= asked[:, 2:3]) & wanted
    rank = selected.cumsum(dim=1) - 1
    selected &= rank < asked[:, 3:4]
    first = torch.argsort(~selected, dim=1, stable=True)   # the selected first, in their order
    take = first.unsqueeze(-1).expand(-1, -1, 4)
    return BatchDetections(torch.gather(clipped, 1, take), torch.gather(ranked, 1, first),
                           torch.gather(labels, 1, first), torch.gather(selected, 1, first))


def request_table(requests: Sequence[RequestSelection], original_sizes_hw: Sequence[tuple[int, int]],
                  classes: int, device: torch.device) -> torch.Tensor:
    """`float32[B, 4 + classes + 1]`, one row per image, made on the host and copied to `device`
    once: its height and width, its request's score threshold (float32, as `select_detections`
    compares it), its cap, then 1 for each label (0 = background) the request wants."""
    rows = [[float(height), float(width), request.score_threshold, float(request.max_detections),
             *(1.0 if request.classes is None or label in request.classes else 0.0
               for label in range(classes + 1))]
            for request, (height, width) in zip(requests, original_sizes_hw, strict=True)]
    return torch.tensor(rows, dtype=torch.float32, device=device)


def scaled_boxes(boxes: torch.Tensor, sizes_hw: torch.Tensor, input_size_hw: tuple[int, int]) -> torch.Tensor:
    """`transform.postprocess`'s `resize_boxes`: each coordinate times (original size / input
    size), the ratio in float32."""
    ratio_height = sizes_hw[:, 0] / input_size_hw[0]
    ratio_width = sizes_hw[:, 1] / input_size_hw[1]
    xmin, ymin, xmax, ymax = boxes.unbind(-1)
    return torch.stack((xmin * ratio_width[:, None], ymin * ratio_height[:, None],
                        xmax * ratio_width[:, None], ymax * ratio_height[:, None]), dim=-1)


def clip_axis(values: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """`clip_boxes_to_image`'s clamp to [0, limit] with each image's own limit."""
    return torch.minimum(values.clamp(min=0), limit.view(-1, 1, 1))
