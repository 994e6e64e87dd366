"""TensorFlow's model-zoo SSD MobileNetV2 COCO (`ssd_mobilenet_v2_coco_2018_03_29`) as a
torchvision SSD, so that it serves wherever the project's SSD-family detectors do (the per-image
and the batched postprocess, OpenVINO and ONNX Runtime for its backbone and head).

What differs from torchvision's SSDs, each as the frozen graph computes it:
- the backbone is MobileNetV2 (torchvision's `mobilenet_v2().features`, layer for layer) with
  TensorFlow's "SAME" padding (asymmetric where a stride-2 convolution meets an even side:
  300 -> 150, 150 -> 75, 38 -> 19, 10 -> 5, 2 -> 1) and batch norms with epsilon 0.001; its first
  feature map is the expansion output of block 14 (TensorFlow's `expanded_conv_13`, 576 channels
  at 19x19), its second the last 1x1 convolution (1280 at 10x10), then four extra layers (a 1x1
  convolution, a 3x3 stride-2 depthwise one and a 1x1 one each: 512 at 5x5, 256 at 3x3, 256 at
  2x2, 128 at 1x1);
- the heads are 3x3 convolutions (torchvision's `SSDHead`), 91 classes (0 the background, 1..90
  COCO's ids: torchvision's COCO category list numbers them the same way); the box encodings are
  stored in torchvision's order (tx, ty, tw, th: the conversion swaps TensorFlow's ty/tx and
  th/tw) and decoded by the same coder, scales 10, 10, 5, 5;
- anchors: TensorFlow's SSD anchor generator (`TfSsdAnchorGenerator`), 1,917 at 300x300;
- scores are the sigmoid of each class's logit, not a softmax over classes, and the
  postprocess drops boxes left with no area after clipping, as the graph's
  `MultiClassNonMaxSuppression` does; per-class NMS at IoU 0.6, at most 100 detections;
- the input is resized to 300x300 by TensorFlow 1's bilinear resize (`tf1_bilinear_resize`:
  source pixel = output pixel x scale, no half-pixel offset, no antialiasing), then scaled to
  [-1, 1] by the transform's normalisation (mean = std = 0.5 of [0, 1] pixels), once, as the
  graph resizes first and scales the resized pixels.

torchvision's box decoding clamps the width and height encodings at log(1000 / 16) (a box 62 times
its anchor); the graph does not. Boxes that large leave the image and are clipped either way.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
from timm.layers import create_conv2d
from torch import nn
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.ssd import SSD, SSDHead
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.models.mobilenetv2 import mobilenet_v2
from torchvision.ops import boxes as box_ops
from torchvision.ops.misc import Conv2dNormActivation
from torchvision.transforms.v2 import functional as F

ModuleType = TypeVar("ModuleType", bound=nn.Module)
ARCHITECTURE = "ssd_mobilenet_v2_tf"
INPUT_SIZE = 300
NUM_CLASSES = 91                        # the background and COCO's ids 1..90 (with gaps)
BATCH_NORM_EPSILON = 0.001
FEATURE_CHANNELS = (576, 1280, 512, 256, 256, 128)
# Extra feature layers after the backbone: (1x1 channels, output channels).
EXTRA_LAYERS = ((256, 512), (128, 256), (128, 256), (64, 128))
# TensorFlow's ssd_anchor_generator as the model's pipeline config sets it.
ANCHOR_MIN_SCALE, ANCHOR_MAX_SCALE = 0.2, 0.95
ANCHOR_ASPECT_RATIOS = (1.0, 2.0, 0.5, 3.0, 0.3333)
LOWEST_LAYER_BOXES = ((0.1, 1.0), (ANCHOR_MIN_SCALE, 2.0), (ANCHOR_MIN_SCALE, 0.5))
# The graph's postprocess (Postprocessor/BatchMultiClassNonMaxSuppression): scores > 0.3,
# IoU 0.6, 100 per class and 100 in all. A served request picks its own score threshold; the
# network keeps candidates down to `score_thresh`, the lowest a request may ask for.
GRAPH_SCORE_THRESHOLD = 0.3
NMS_IOU_THRESHOLD = 0.6
MAX_DETECTIONS = 100


def same_padded(conv: nn.Conv2d) -> nn.Conv2d:
    """`conv` with TensorFlow's "SAME" padding and the same parameters, by timm's
    `create_conv2d(padding="same")`: a fixed symmetric padding where "SAME" is one (stride 1, an
    odd kernel), else timm's `Conv2dSame`, which pads each input for its size (the output side
    is ceil(input / stride); an odd total padding puts its extra row and column after)."""
    (kernel, _), (stride, _), (dilation, _) = conv.kernel_size, conv.stride, conv.dilation
    return create_conv2d(conv.in_channels, conv.out_channels, kernel, stride=stride, dilation=dilation,
                         groups=conv.groups, bias=conv.bias is not None, padding="same",
                         device=conv.weight.device, dtype=conv.weight.dtype)


def with_same_padding(module: ModuleType) -> ModuleType:
    """Every convolution of `module` larger than 1x1 padded as TensorFlow's "SAME" (in place)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Conv2d) and child.kernel_size != (1, 1):
            setattr(module, name, same_padded(child))
        else:
            with_same_padding(child)
    return module


class TfMobileNetV2Features(nn.Module):
    """MobileNetV2's feature extractor for SSD: `float[B, 3, 300, 300]` in [-1, 1] -> six feature
    maps (576 x 19 x 19, 1280 x 10 x 10, 512 x 5 x 5, 256 x 3 x 3, 256 x 2 x 2, 128 x 1 x 1)."""

    def __init__(self) -> None:
        super().__init__()
        norm = partial(nn.BatchNorm2d, eps=BATCH_NORM_EPSILON)
        self.features: nn.Sequential = with_same_padding(mobilenet_v2(weights=None, norm_layer=norm).features)
        extras = []
        in_channels = FEATURE_CHANNELS[1]
        for middle, out in EXTRA_LAYERS:
            extras.append(with_same_padding(nn.Sequential(
                Conv2dNormActivation(in_channels, middle, 1, norm_layer=norm, activation_layer=nn.ReLU6),
                Conv2dNormActivation(middle, middle, 3, stride=2, groups=middle, norm_layer=norm,
                                     activation_layer=nn.ReLU6),
                Conv2dNormActivation(middle, out, 1, norm_layer=norm, activation_layer=nn.ReLU6))))
            in_channels = out
        self.extras = nn.ModuleList(extras)

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        x = self.features[:14](x)
        block = self.features[14].conv
        assert isinstance(block, nn.Sequential)
        first = block[0](x)                  # the expansion output of block 14 (576 channels)
        x = self.features[15:](block[1:](first))
        maps = [first, x]
        for extra in self.extras:
            x = extra(x)
            maps.append(x)
        return OrderedDict((str(index), feature) for index, feature in enumerate(maps))


def anchor_boxes(layer: int, scale: float, next_scale: float) -> list[tuple[float, float]]:
    """(scale, aspect ratio) of each anchor of one cell of feature layer `layer`, in
    TensorFlow's order (the lowest layer: three boxes)."""
    if layer == 0:
        return list(LOWEST_LAYER_BOXES)
    return [(scale, ratio) for ratio in ANCHOR_ASPECT_RATIOS] + [(math.sqrt(scale * next_scale), 1.0)]


def layer_scales(layers: int) -> list[float]:
    """TensorFlow's anchor scales, min to max evenly over `layers`, then 1.0."""
    step = (ANCHOR_MAX_SCALE - ANCHOR_MIN_SCALE) / (layers - 1)
    return [ANCHOR_MIN_SCALE + step * layer for layer in range(layers)] + [1.0]


def tf_ssd_anchors_xyxy(grid_sizes_hw: Sequence[tuple[int, int]], image_size_hw: tuple[int, int],
                        device: torch.device | None = None) -> torch.Tensor:
    """`float[A, 4]`: TensorFlow's SSD anchors for feature maps of `grid_sizes_hw` on an image
    of `image_size_hw`, xyxy in its pixels, ordered by layer, row, column, box (the heads'
    order). Each layer's cells span the image evenly (stride 1 / side, offset half a stride);
    anchors are not clipped to the image."""
    height, width = image_size_hw
    # TensorFlow scales a non-square image's base anchor so that its boxes stay square.
    base_h, base_w = min(height, width) / height, min(height, width) / width
    scales = layer_scales(len(grid_sizes_hw))
    layers = []
    for layer, (rows, columns) in enumerate(grid_sizes_hw):
        boxes = torch.tensor(anchor_boxes(layer, scales[layer], scales[layer + 1]), dtype=torch.float64)
        ratio_sqrt = boxes[:, 1].sqrt()
        box_h, box_w = boxes[:, 0] / ratio_sqrt * base_h, boxes[:, 0] * ratio_sqrt * base_w
        center_y = (torch.arange(rows, dtype=torch.float64) + 0.5) / rows
        center_x = (torch.arange(columns, dtype=torch.float64) + 0.5) / columns
        cy = center_y.view(-1, 1, 1).expand(rows, columns, len(boxes))
        cx = center_x.view(1, -1, 1).expand(rows, columns, len(boxes))
        hh, hw = (box_h / 2).expand(rows, columns, -1), (box_w / 2).expand(rows, columns, -1)
        layers.append(torch.stack([(cx - hw) * width, (cy - hh) * height, (cx + hw) * width,
                                   (cy + hh) * height], dim=-1).reshape(-1, 4))
    return torch.cat(layers).to(device=device, dtype=torch.float32)


class TfSsdAnchorGenerator(nn.Module):
    """Called as torchvision's anchor generators are: (images, feature maps) -> each image's
    anchors `float[A, 4]` xyxy in the batch's input pixels."""

    def num_anchors_per_location(self) -> list[int]:
        return [len(anchor_boxes(layer, 0.0, 0.0)) for layer in range(len(FEATURE_CHANNELS))]

    def forward(self, image_list: ImageList, feature_maps: list[torch.Tensor]) -> list[torch.Tensor]:
        size_hw = (int(image_list.tensors.shape[-2]), int(image_list.tensors.shape[-1]))
        grids = [(int(feature.shape[-2]), int(feature.shape[-1])) for feature in feature_maps]
        anchors = tf_ssd_anchors_xyxy(grids, size_hw, image_list.tensors.device)
        return [anchors] * len(image_list.image_sizes)


def tf1_bilinear_resize(images: torch.Tensor, size_hw: tuple[int, int],
                        to_float: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.float
                        ) -> torch.Tensor:
    """`[N, C, H, W]` images -> `float[N, C, h, w]` as TensorFlow 1's `ResizeBilinear` with
    `align_corners=False` and no `half_pixel_centers` (the frozen graph's preprocessor): output
    pixel i reads input position i * (H / h) (float32), between the pixels below and above it
    (the last row and column repeated), rows interpolated along x first, then along y.

    Only the rows read are converted by `to_float` (uint8 images stay uint8 until then; the
    conversion is elementwise, so where it happens does not change a value). Columns are
    gathered from the rows viewed as one matrix: `index_select` along the last of four
    dimensions takes about three times as long on a CPU."""
    rows_low, rows_high, row_weights = tf1_interpolation(images.shape[-2], size_hw[0], images.device)
    columns_low, columns_high, column_weights = tf1_interpolation(images.shape[-1], size_hw[1],
                                                                  images.device)

    def along_x(rows: torch.Tensor) -> torch.Tensor:
        matrix = to_float(rows).reshape(-1, rows.shape[-1])
        left, right = matrix.index_select(1, columns_low), matrix.index_select(1, columns_high)
        return (left + (right - left) * column_weights).view(*rows.shape[:-1], size_hw[1])

    top, bottom = along_x(images.index_select(-2, rows_low)), along_x(images.index_select(-2, rows_high))
    return top + (bottom - top) * row_weights.unsqueeze(-1)


def tf1_interpolation(in_size: int, out_size: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One axis of `tf1_bilinear_resize`: the lower and upper source index and the weight of the
    upper one for each output index (TensorFlow's `compute_interpolation_weights`)."""
    scale = torch.tensor(in_size, dtype=torch.float32) / torch.tensor(out_size, dtype=torch.float32)
    position = torch.arange(out_size, dtype=torch.float32) * scale
    low = position.floor()
    upper = position.ceil().long().clamp(max=in_size - 1)
    return (low.long().clamp(min=0).to(device), upper.to(device), (position - low).to(device))


class Tf1ResizeTransform(GeneralizedRCNNTransform):
    """torchvision's detection transform with TensorFlow 1's bilinear resize
    (`tf1_bilinear_resize`) in place of PyTorch's half-pixel one, and the normalisation after the
    resize, as the frozen graph's preprocessor scales the resized pixels (torchvision's
    normalises first, over every pixel of the full-size image). Boxes map back to each image by
    the same ratio of sizes."""

    def normalize(self, image: torch.Tensor) -> torch.Tensor:
        return image        # in resize_batch, after the resize

    def resize(self, image: torch.Tensor,
               target: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
        if target is not None:
            raise ValueError("this transform serves inference only (no targets)")
        return self.resize_batch(image[None])[0], None

    def resize_batch(self, images: torch.Tensor) -> torch.Tensor:
        """`float[N, C, H, W]` images of one size in [0, 1] -> the network's normalised input."""
        return self.scaled(tf1_bilinear_resize(images, self.input_size_hw()))

    def uint8_batch(self, images: torch.Tensor) -> torch.Tensor:
        """`uint8[N, C, H, W]` images of one size -> the network's normalised input, bit for bit
        `resize_batch` of the images converted by torchvision's `to_dtype` (only the rows the
        resize reads are converted)."""
        to_float = partial(F.to_dtype, dtype=torch.float32, scale=True)
        return self.scaled(tf1_bilinear_resize(images, self.input_size_hw(), to_float))

    def input_size_hw(self) -> tuple[int, int]:
        assert self.fixed_size is not None
        return self.fixed_size[1], self.fixed_size[0]

    def scaled(self, images: torch.Tensor) -> torch.Tensor:
        """`float[N, C, h, w]` pixels in [0, 1] normalised by torchvision's own normalisation
        (which this transform's `normalize` defers to here, after the resize)."""
        return super().normalize(images)


class TfSsdMobileNetV2(SSD):
    """The detector (see the module's docstring). `score_thresh`: the lowest score a candidate
    may have (the lowest a request may ask for); `detections_per_img`: the most kept."""

    score_activation = "sigmoid"

    def __init__(self, num_classes: int = NUM_CLASSES, score_thresh: float = 0.01,
                 detections_per_img: int = MAX_DETECTIONS, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"unexpected arguments: {', '.join(kwargs)}")
        anchors = TfSsdAnchorGenerator()
        head = with_same_padding(SSDHead(list(FEATURE_CHANNELS), anchors.num_anchors_per_location(),
                                         num_classes))
        # Every candidate above the threshold goes to NMS (TensorFlow keeps 100 per class after
        # NMS and 100 in all, which keeps the same detections as no limit before NMS).
        super().__init__(TfMobileNetV2Features(), anchors, (INPUT_SIZE, INPUT_SIZE), num_classes,
                         image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], head=head,
                         score_thresh=score_thresh, nms_thresh=NMS_IOU_THRESHOLD,
                         detections_per_img=detections_per_img, topk_candidates=1 << 30)
        self.transform = Tf1ResizeTransform(INPUT_SIZE, INPUT_SIZE, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5],
                                            size_divisible=1, fixed_size=(INPUT_SIZE, INPUT_SIZE))

    def postprocess_detections(self, head_outputs: dict[str, torch.Tensor],
                               image_anchors: list[torch.Tensor],
                               image_shapes: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        """As torchvision's SSD postprocess, with sigmoid scores and boxes of no area dropped."""
        scores = torch.sigmoid(head_outputs["cls_logits"])
        detections = []
        for regression, image_scores, anchors, shape in zip(head_outputs["bbox_regression"], scores,
                                                            image_anchors, image_shapes, strict=True):
            boxes = box_ops.clip_boxes_to_image(self.box_coder.decode_single(regression, anchors), shape)
            detections.append(self.image_detections(boxes, image_scores))
        return detections

    def image_detections(self, boxes: torch.Tensor, scores: torch.Tensor) -> dict[str, torch.Tensor]:
        """One image's clipped boxes `float[A, 4]` and scores `float[A, C]` -> its detections."""
        has_area = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        class_scores = scores[:, 1:].T         # class by class, as torchvision's loop collects them
        candidates = (class_scores > self.score_thresh) & has_area
        class_index, anchor_index = candidates.nonzero(as_tuple=True)
        candidate_scores = class_scores[class_index, anchor_index]
        labels = class_index + 1
        keep = box_ops.batched_nms(boxes[anchor_index], candidate_scores, labels,
                                   self.nms_thresh)[: self.detections_per_img]
        return {"boxes": boxes[anchor_index[keep]], "scores": candidate_scores[keep], "labels": labels[keep]}


def ssd_mobilenet_v2_tf(**kwargs: Any) -> TfSsdMobileNetV2:
    """The architecture by its name in `config/models.yaml` (`source: project`)."""
    return TfSsdMobileNetV2(**kwargs)
