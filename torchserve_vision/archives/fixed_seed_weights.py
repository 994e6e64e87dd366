"""Fixed-seed weights of a real architecture whose answers still differ from image to image.

Plain random initialisation often gives every photo the same answer (BatchNorm's running
statistics do not match the activations, and small output layers give near-zero logits), which
would hide a mix-up between requests. Calibrating BatchNorm on a few real images and scaling the
output layer to a useful logit spread fixes that, deterministically.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


@torch.no_grad()
def calibrate_batch_norm(model: nn.Module, batches: Sequence[torch.Tensor]) -> None:
    """Set every BatchNorm's running mean/var to the exact average over `batches` (no forward
    pass for a model without one, such as SSD300's VGG backbone)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average
    model.train()
    for batch in batches:
        model(batch)
    model.eval()
    for norm in norms:
        norm.momentum = 0.1


@torch.no_grad()
def scale_output_layer(model: nn.Module, batches: Sequence[torch.Tensor], logit_std: float) -> None:
    """Scale the last Linear layer so the logits over `batches` have standard deviation `logit_std`."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("the model has no Linear output layer to scale")
    logits = torch.cat([model(batch) for batch in batches])
    factor = logit_std / max(float(logits.std()), 1e-12)
    linears[-1].weight.mul_(factor)
    if linears[-1].bias is not None:
        linears[-1].bias.mul_(factor)


def calibrated_classifier(model: nn.Module, batches: Sequence[torch.Tensor],
                          logit_std: float = 3.0) -> nn.Module:
    """Calibrate a freshly initialised classifier in place and return it in eval mode."""
    calibrate_batch_norm(model, batches)
    scale_output_layer(model, batches, logit_std)
    return model.eval()


def detector_classification_layers(model: nn.Module) -> list[nn.Conv2d | nn.Linear]:
    """The layers producing a torchvision detector's class logits."""
    from torchvision.models.detection import FCOS, RetinaNet
    from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN
    from torchvision.models.detection.ssd import SSD

    if isinstance(model, GeneralizedRCNN):
        return [model.roi_heads.box_predictor.cls_score]
    if isinstance(model, (RetinaNet, FCOS)):
        return [model.head.classification_head.cls_logits]
    if isinstance(model, SSD):
        return [[m for m in block.modules() if isinstance(m, nn.Conv2d)][-1]
                for block in model.head.classification_head.module_list]
    raise ValueError(f"no known classification layers in {type(model).__name__}")


@torch.no_grad()
def calibrated_detector(model: nn.Module, images: Sequence[torch.Tensor]) -> nn.Module:
    """Calibrate a freshly initialised torchvision detector in place; return it in eval mode.

    `images` are `float[3, H, W]` in [0, 1]. The backbone's BatchNorm statistics are set from
    them, and the class-logit layers' weights are scaled: for softmax heads (Faster R-CNN, SSD)
    so the weight term spreads with standard deviation 2; for sigmoid heads (RetinaNet, FCOS,
    whose scores saturate easily) so its 99.9th percentile reaches 4. Either way scores separate
    without piling up at 1.0.
    """
    from torchvision.models.detection import FCOS, RetinaNet

    sigmoid_head = isinstance(model, (RetinaNet, FCOS))
    detector: Any = model.eval()  # torchvision detectors: .transform and .backbone
    transformed, _ = detector.transform(list(images))
    calibrate_batch_norm(detector.backbone, [transformed.tensors])
    layers = detector_classification_layers(model)
    responses: list[torch.Tensor] = []

    def record(layer: nn.Module, _inputs: object, output: torch.Tensor) -> None:
        bias = getattr(layer, "bias", None)
        shape = (1, -1, 1, 1) if output.ndim == 4 else (1, -1)
        weight_term = output - bias.view(shape) if bias is not None else output
        responses.append(weight_term.abs().flatten()[::7])  # a subsample is plenty

    hooks = [layer.register_forward_hook(record) for layer in layers]
    model(list(images))
    for hook in hooks:
        hook.remove()
    magnitudes = torch.cat(responses)[:8_000_000]
    if sigmoid_head:
        factor = 4.0 / max(float(torch.quantile(magnitudes, 0.999)), 1e-12)
    else:
        factor = 2.0 / max(float(magnitudes.square().mean().sqrt()), 1e-12)
    for layer in layers:
        layer.weight.mul_(factor)
    return model.eval()


def calibration_photos(max_side: int = 512) -> list[torch.Tensor]:
    """scikit-image's bundled photos as `float[3, H, W]` in [0, 1] (installed with the project)."""
    from pathlib import Path

    import skimage
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import functional as F

    photos = []
    for name in ("chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"):
        data = (Path(skimage.__file__).parent / "data" / name).read_bytes()
        image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB)
        if max(image.shape[-2:]) > max_side:
            image = F.resize(image, size=None, max_size=max_side, antialias=True)
        photos.append(F.to_dtype(image, torch.float32, scale=True))
    return photos


def fixed_seed_model(model_factory: Callable[[], nn.Module], seed: int, detector: bool) -> nn.Module:
    """A model from `model_factory` under a fixed seed, calibrated on the bundled photos."""
    torch.manual_seed(seed)
    model = model_factory()
    photos = calibration_photos()
    if detector:
        return calibrated_detector(model, photos)
    from torchvision.transforms.v2 import functional as F

    batch = torch.stack([F.resize(F.center_crop(p, [min(p.shape[-2:])] * 2), [224, 224]) for p in photos])
    return calibrated_classifier(model, [F.normalize(batch, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
