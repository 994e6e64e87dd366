"""What the resize to the detector's input moves, on real photos: the default detector
(TensorFlow's SSD MobileNetV2 COCO, handlers.model.tf_ssd_mobilenet) with its served resize,
TensorFlow 1's bilinear (the frozen graph's own: source = output x scale, no antialiasing),
against PyTorch's half-pixel bilinear (torchvision's detection transform, OpenCV's INTER_LINEAR)
and the antialiased bilinear (Pillow's, the project's classifier resize), each image's
detections above the score threshold matched by label and IoU.

    torchserve-vision lab detector-resize                       # the project's photos + 30 variants
    torchserve-vision lab detector-resize --variants 100 --threshold 0.3

Per resize: images whose set of labels (clear of the threshold by `margin`) changed, detections
found by one and not the other, and for matched detections the largest score shift and box
shift (in pixels of the 300 x 300 input).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from PIL import Image
from torch import nn
from torchvision.ops import box_iou
from torchvision.transforms.v2 import functional as F

from handlers.model.ssd_engine import SsdBackboneHead, image_anchors_xyxy
from handlers.model.tf_ssd_mobilenet import INPUT_SIZE, TfSsdMobileNetV2, tf1_bilinear_resize
from torchserve_vision.photo_sets import project_photos, variant_jpegs

Resize = Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]
RESIZES: dict[str, Resize] = {
    "tf1-bilinear": tf1_bilinear_resize,
    "half-pixel-bilinear": lambda images, size: nn.functional.interpolate(
        images, size=list(size), mode="bilinear", align_corners=False),
    "antialiased-bilinear": lambda images, size: nn.functional.interpolate(
        images, size=list(size), mode="bilinear", align_corners=False, antialias=True),
}
REFERENCE = "tf1-bilinear"
MATCH_IOU = 0.5


@dataclass(frozen=True)
class ResizeShift:
    resize: str
    images: int
    images_with_other_labels: int
    unmatched_detections: int
    matched_detections: int
    max_score_shift: float
    max_box_shift_px: float


def detections_300(network: TfSsdMobileNetV2, image: torch.Tensor,
                   resize: Resize) -> dict[str, torch.Tensor]:
    """One float image in [0, 1] -> its detections, boxes in the 300 x 300 input's pixels."""
    normalised = (image[None] - 0.5) / 0.5
    batch = resize(normalised, (INPUT_SIZE, INPUT_SIZE))
    regression, logits = SsdBackboneHead(network)(batch)
    return network.postprocess_detections({"bbox_regression": regression, "cls_logits": logits},
                                          [image_anchors_xyxy(network)], [(INPUT_SIZE, INPUT_SIZE)])[0]


def clear(found: dict[str, torch.Tensor], threshold: float, margin: float) -> dict[str, torch.Tensor]:
    keep = found["scores"] >= threshold + margin
    return {key: value[keep] for key, value in found.items()}


def labels_of(found: dict[str, torch.Tensor], threshold: float, margin: float) -> set[int]:
    """The labels of detections clear of the threshold (above it by `margin`); a detection within
    the margin may fall on either side of it under any resize, so it counts for neither side."""
    return set(clear(found, threshold, margin)["labels"].tolist())


def matched(reference: dict[str, torch.Tensor],
            other: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """Pairs (reference index, other index) of one label, greedily by IoU >= MATCH_IOU."""
    if not len(reference["labels"]) or not len(other["labels"]):
        return []
    overlaps = box_iou(reference["boxes"], other["boxes"])
    overlaps[reference["labels"][:, None] != other["labels"][None, :]] = 0
    pairs, used = [], set()
    for row in range(overlaps.shape[0]):
        best = int(overlaps[row].argmax())
        if overlaps[row, best] >= MATCH_IOU and best not in used:
            pairs.append((row, best))
            used.add(best)
    return pairs


def measure(variants: int = 30, threshold: float = 0.3, margin: float = 0.01,
            seed: int = 7) -> list[ResizeShift]:
    """Every resize of RESIZES against the served one on the project's photos and `variants`
    seeded variants (crops, scales, JPEG re-encodings of them)."""
    from torchserve_vision.archives.tf_ssd_weights import ssd_mobilenet_v2_coco_state_dict

    network = TfSsdMobileNetV2(score_thresh=threshold - margin)
    network.load_state_dict(ssd_mobilenet_v2_coco_state_dict())
    network.eval()
    photos = project_photos()
    encoded = variant_jpegs(photos, len(photos) + variants, seed)
    images = [F.to_dtype(F.pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB")), torch.float32,
                         scale=True) for data in encoded]
    with torch.inference_mode():
        found = {name: [detections_300(network, image, resize) for image in images]
                 for name, resize in RESIZES.items()}
    return [shift(name, found[REFERENCE], found[name], threshold, margin)
            for name in RESIZES if name != REFERENCE]


def shift(name: str, reference: Sequence[dict[str, torch.Tensor]],
          other: Sequence[dict[str, torch.Tensor]], threshold: float, margin: float) -> ResizeShift:
    other_labels = unmatched = matches = 0
    score_shift = box_shift = 0.0
    for ours, theirs in zip(reference, other, strict=True):
        other_labels += labels_of(ours, threshold, margin) != labels_of(theirs, threshold, margin)
        ours_clear, theirs_clear = clear(ours, threshold, margin), clear(theirs, threshold, margin)
        pairs = matched(ours_clear, theirs)
        unmatched += len(ours_clear["labels"]) - len(pairs) + len(theirs_clear["labels"]) - len(
            matched(theirs_clear, ours))
        for mine, their in pairs:
            matches += 1
            score = ours_clear["scores"][mine] - theirs["scores"][their]
            box = ours_clear["boxes"][mine] - theirs["boxes"][their]
            score_shift = max(score_shift, abs(float(score)))
            box_shift = max(box_shift, float(box.abs().max()))
    return ResizeShift(name, len(reference), other_labels, unmatched, matches, round(score_shift, 4),
                       round(box_shift, 2))


def table(shifts: Sequence[ResizeShift]) -> str:
    lines = [f"against the served resize ({REFERENCE}), detections above the threshold:"]
    for entry in shifts:
        lines.append(f"  {entry.resize:<22} {entry.images_with_other_labels}/{entry.images} images with "
                     f"other labels, {entry.unmatched_detections} unmatched detections; matched "
                     f"{entry.matched_detections}: score up to {entry.max_score_shift:.4f}, box up to "
                     f"{entry.max_box_shift_px:.2f} px of {INPUT_SIZE}")
    return "\n".join(lines)


def as_json(shifts: Sequence[ResizeShift]) -> list[dict[str, Any]]:
    return [asdict(entry) for entry in shifts]

