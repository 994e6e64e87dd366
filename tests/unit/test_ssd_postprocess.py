"""handlers.task.ssd_postprocess against torchvision's own postprocess, on the served SSDlite
(config/models.yaml's fixed-seed network, calibrated on the project's photos) and on the default
detector's (TensorFlow's SSD MobileNetV2 with its real COCO weights: sigmoid scores, its own
per-image postprocess): for the project's photos and seeded variants, at the default request
threshold (0.3) and at the lowest a request may ask (0.001; 0.05 for the default detector), the
same detections in the same order, the same labels, scores and boxes bit for bit, as the network's
`postprocess_detections` + `transform.postprocess` + this project's clip and per-request
selection give (detections of exactly equal score in either's order); with a class filter and a
cap too. And Cluster-NMS against
torchvision's NMS kernel on random boxes, with the coordinate shift of its `batched_nms`."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
from PIL import Image
from torchvision.ops import batched_nms, clip_boxes_to_image
from torchvision.transforms.v2 import functional as F

from handlers.ground.kind_options import DetectionOptions
from handlers.model.ssd_engine import SsdBackboneHead, image_anchors_xyxy, ssd_input_size_hw
from handlers.task import ssd_postprocess
from handlers.task.detection import DetectionTensors, candidate_score_threshold, select_detections
from handlers.task.ssd_postprocess import (
    RequestSelection,
    SsdPostprocessSettings,
    batched_ssd_detections,
    cluster_nms,
    nms_coordinates,
    pairwise_iou_exceeds,
)
from tests.detections import assert_identical_but_tie_order
from tests.images import photo_bytes
from torchserve_vision.photo_sets import project_photos, variant_jpegs

PHOTOS = ["astronaut.png", "rocket.jpg", "chelsea.png", "coffee.png", "motorcycle_left.png"]


@pytest.fixture(scope="module")
def ssdlite() -> torch.nn.Module:
    """config/models.yaml's ssdlite320 as its archive is built: the architecture under its fixed
    seed, calibrated on the bundled photos."""
    from handlers.model.model_loading import create_architecture
    from torchserve_vision import paths
    from torchserve_vision.archives.build import model_source
    from torchserve_vision.archives.fixed_seed_weights import fixed_seed_model
    from torchserve_vision.model_descriptions import load_descriptions

    (description,) = [d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == "ssdlite320"]
    source = model_source(description, 91)
    seed = int(description.weights.split(":")[1])
    return fixed_seed_model(lambda: create_architecture(source), seed, detector=True).eval()


@pytest.fixture(scope="module")
def ssd_mobilenet_v2() -> torch.nn.Module:
    """The default detector with the weights its archive is built with."""
    from handlers.model.tf_ssd_mobilenet import TfSsdMobileNetV2
    from torchserve_vision.archives.tf_ssd_weights import ssd_mobilenet_v2_coco_state_dict

    network = TfSsdMobileNetV2(score_thresh=0.05)
    network.load_state_dict(ssd_mobilenet_v2_coco_state_dict())
    return network.eval()


def images(variants: int) -> list[torch.Tensor]:
    """The photos and seeded variants as float images in [0, 1] (sizes differ)."""
    encoded = [photo_bytes(name) for name in PHOTOS] + variant_jpegs(project_photos(), variants, seed=11)
    return [F.to_dtype(F.pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB")), torch.float32,
                       scale=True) for data in encoded]


def head_outputs(network, batch: list[torch.Tensor]):
    with torch.inference_mode():
        transformed, _ = network.transform(batch)
        regression, logits = SsdBackboneHead(network)(transformed.tensors)
    return transformed, regression, logits


def torchvisions(network, batch, transformed, regression, logits, options: list[DetectionOptions]):
    """torchvision's postprocess at the batch's candidate threshold, then the clip and selection."""
    configured = network.score_thresh
    network.score_thresh = candidate_score_threshold(configured, min(o.score_threshold for o in options))
    try:
        with torch.inference_mode():
            found = network.postprocess_detections({"bbox_regression": regression, "cls_logits": logits},
                                                   [image_anchors_xyxy(network)] * len(batch),
                                                   transformed.image_sizes)
            found = network.transform.postprocess(found, transformed.image_sizes,
                                                  [tuple(image.shape[-2:]) for image in batch])
    finally:
        network.score_thresh = configured
    return [select_detections(DetectionTensors(clip_boxes_to_image(f["boxes"], tuple(image.shape[-2:])),
                                               f["scores"], f["labels"]), asked)
            for f, image, asked in zip(found, batch, options, strict=True)]


def batched(network, batch, regression, logits, options: list[DetectionOptions]):
    lowest = candidate_score_threshold(network.score_thresh, min(o.score_threshold for o in options))
    with torch.inference_mode():
        result = batched_ssd_detections(
            regression, logits, image_anchors_xyxy(network), ssd_input_size_hw(network),
            [tuple(image.shape[-2:]) for image in batch], SsdPostprocessSettings.of(network), lowest,
            [RequestSelection(o.score_threshold, o.classes, o.max_detections) for o in options])
    return [DetectionTensors(boxes[selected], scores[selected], labels[selected])
            for boxes, scores, labels, selected in zip(result.boxes_xyxy, result.scores, result.labels,
                                                       result.selected, strict=True)]


def rows(found: DetectionTensors) -> list:
    return list(zip(found.class_indices.tolist(), found.scores.tolist(), found.boxes_xyxy.tolist(),
                    strict=True))


def assert_identical(ours: list[DetectionTensors], theirs: list[DetectionTensors]) -> int:
    """Bit for bit, but the order among exactly equal scores (module docstring: torchvision's is
    its sort's; two classes' detections can tie, seen on the photos with one torch thread)."""
    found = 0
    for mine, reference in zip(ours, theirs, strict=True):
        assert_identical_but_tie_order(rows(mine), rows(reference))
        found += len(reference.scores)
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("detector", "threshold", "variants"),
                         [("ssdlite", 0.3, 6), ("ssdlite", 0.001, 2), ("ssd_mobilenet_v2", 0.3, 6),
                          ("ssd_mobilenet_v2", 0.05, 2)])
def test_the_batched_postprocess_gives_the_networks_detections_bit_for_bit(request, detector, threshold,
                                                                           variants):
    """At 0.001 candidates of one class tie in score (99 such candidates over the photos and six
    variants, counted on 2026-11-28): the answers agree there too."""
    ssdlite = request.getfixturevalue(detector)
    batch = images(variants)
    transformed, regression, logits = head_outputs(ssdlite, batch)
    asked = DetectionOptions(score_threshold=threshold, iou_threshold=0.5, max_detections=300)
    options = [asked] * len(batch)
    found = assert_identical(batched(ssdlite, batch, regression, logits, options),
                             torchvisions(ssdlite, batch, transformed, regression, logits, options))
    assert found > (10 * len(batch) if threshold < 0.1 else len(batch) // 2)   # detections to compare
    # requests of one batch keep their own thresholds, classes and caps
    mixed = [replace(asked, score_threshold=0.2 + 0.05 * (index % 3), max_detections=1 + index % 4,
                     classes=frozenset({1, 3, 18}) if index % 2 else None) for index in range(len(batch))]
    mixed = [replace(option, score_threshold=max(option.score_threshold, threshold)) for option in mixed]
    assert_identical(batched(ssdlite, batch, regression, logits, mixed),
                     torchvisions(ssdlite, batch, transformed, regression, logits, mixed))


def random_boxes(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    corners = torch.rand(count, 2, generator=generator) * 300
    sides = torch.rand(count, 2, generator=generator) * 60 + 1
    return torch.cat([corners, corners + sides], dim=1)


@pytest.mark.parametrize("seed", range(6))
def test_cluster_nms_keeps_what_torchvisions_nms_keeps(seed):
    """One image, three classes of 150 candidates each, best first: Cluster-NMS on the shifted
    coordinates keeps exactly what `batched_nms` (its coordinate trick: 450 candidates) keeps."""
    classes, k = 3, 150
    boxes = random_boxes(classes * k, seed)
    scores = torch.rand(classes * k, generator=torch.Generator().manual_seed(100 + seed))
    labels = torch.arange(1, classes + 1).repeat_interleave(k)
    expected = set(batched_nms(boxes, scores, labels, 0.45).tolist())
    by_class = torch.stack([torch.argsort(scores[labels == c], descending=True) + (c - 1) * k
                            for c in range(1, classes + 1)])              # [classes, k], best first
    grouped = boxes[by_class].unsqueeze(0)                                  # [1, classes, k, 4]
    valid = torch.ones(1, classes, k, dtype=torch.bool)
    shifted = nms_coordinates(grouped, valid)
    later = torch.ones(k, k, dtype=torch.bool).triu(1)
    kept = cluster_nms(pairwise_iou_exceeds(shifted, 0.45) & later, valid)
    assert set(by_class[kept[0]].tolist()) == expected


def test_cluster_nms_settles_past_one_check_when_suppressions_chain():
    """A chain of boxes each overlapping the next: greedy keeps every other one, which takes as
    many rounds as the chain is long, past the first convergence checks."""
    length = 3 * ssd_postprocess.CONVERGENCE_CHECK_EVERY + 5
    chain = torch.tensor([[float(i), 0.0, i + 1.5, 1.0] for i in range(length)])
    later = torch.ones(length, length, dtype=torch.bool).triu(1)
    suppresses = pairwise_iou_exceeds(chain, 0.2) & later
    kept = cluster_nms(suppresses, torch.ones(length, dtype=torch.bool))
    assert kept.tolist() == [index % 2 == 0 for index in range(length)]


@pytest.mark.parametrize("fixed_size_wh", [(320, 320), (320, 256)])
def test_the_batched_transform_is_the_networks_bit_for_bit(fixed_size_wh):
    """Images of three sizes (two alike) through `ssd_input_batch` and through the network's own
    transform (normalize, then resize to its fixed size, (width, height) in torchvision)."""
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    from handlers.model.ssd_engine import ssd_input_batch, transformed_batch

    network = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None).eval()
    network.transform.fixed_size = fixed_size_wh
    generator = torch.Generator().manual_seed(1)
    uint8 = [torch.randint(0, 256, (3, *size_hw), dtype=torch.uint8, generator=generator)
             for size_hw in [(480, 640), (300, 451), (480, 640)]]
    expected = transformed_batch(network, [F.to_dtype(image, torch.float32, scale=True) for image in uint8])
    batch = ssd_input_batch(network, uint8, torch.device("cpu"))
    assert torch.equal(batch, expected.tensors)
    assert expected.image_sizes == [ssd_input_size_hw(network)] * 3
