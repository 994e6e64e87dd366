"""A classifier for the engines beside AOTInductor, for the archive builder: an ONNX model (ONNX
Runtime) and an OpenVINO IR, each with a dynamic batch dimension and fp32 weights (the precision
is chosen where the model is compiled, at worker start: handlers/model/engine_runners.py), and
where `compile.int8` asks for it an int8 OpenVINO model quantized from the IR and gated
(torchserve_vision/archives/int8_quantization.py).

Measured on a 2-core AMD EPYC (Zen 4), EfficientNet-Lite0: the OpenVINO conversion takes about
2 s; the ONNX export 0.5 s (6.4 through torch.export, on the AMX Xeon: docs/benchmarks.md, "The
ONNX export"); each adds one copy of the weights to the archive (docs/benchmarks.md,
"Engines"). An SSD-family detector's backbone and head are exported the same way
(`export_detector_engines`), and so is an Ultralytics TorchScript detection export, for
OpenVINO (`export_ultralytics_engines`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from timm.layers.conv2d_same import Conv2dSame
from timm.layers.padding import pad_same_arg
from torch import nn

from handlers.ground.limits import ImageLimits
from handlers.model.compiled_model import PROBE_FILE
from handlers.model.openvino_package import openvino_package
from handlers.model.runner_selection import EngineModel
from handlers.model.ssd_engine import SSD_OUTPUT_NAMES, SsdBackboneHead
from handlers.request.decode import decode_image_bytes
from handlers.task.letterbox import ultralytics_letterboxed
from torchserve_vision.archives.compile_ahead import CompileRequest, write_probe_photos
from torchserve_vision.archives.int8_quantization import INT8_FILE, Int8Gate, build_int8_model
from torchserve_vision.archives.ultralytics_exports import LETTERBOX_FILL
from torchserve_vision.photos import PROBE_PHOTOS, photo_path

CLASSIFIER_OUTPUT_NAMES = ("logits",)
ONNX_FILE = "model.onnx"
OPENVINO_FILE = "model-openvino.xml"   # and model-openvino.bin beside it


def example_input(input_shape_chw: tuple[int, int, int]) -> torch.Tensor:
    # Batch 2: a dimension exported from an example of size 1 would be specialised to 1.
    return torch.zeros(2, *input_shape_chw)


def with_fixed_same_padding(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """`model`, or where it has timm's `Conv2dSame` (TensorFlow's "SAME" padding, computed from
    each input's height and width) a copy in which each pads by the fixed amounts `example`'s
    size gives it, then convolves unpadded: the same answers at that size. An exported model's
    height and width are fixed, and a traced graph that computes the padding from the input's
    shape kept its Pad operations apart from the convolutions (SSD MobileNetV2 on ONNX Runtime:
    133 ms per batch of 4 against 114 with fixed padding)."""
    names = [name for name, module in model.named_modules() if isinstance(module, Conv2dSame)]
    if not names:
        return model
    sizes: dict[str, list[int]] = {}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda _module, args, name=name: sizes.__setitem__(name, list(args[0].shape[-2:])))
        for name in names]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for hook in hooks:
            hook.remove()
    fixed = copy.deepcopy(model)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = fixed.get_submodule(parent_name)
        same = getattr(parent, child)
        plain = nn.Conv2d(same.in_channels, same.out_channels, same.kernel_size, same.stride, 0,
                          same.dilation, same.groups, same.bias is not None)
        plain.load_state_dict(same.state_dict())
        left, right, top, bottom = pad_same_arg(sizes[name], list(same.kernel_size), list(same.stride),
                                                list(same.dilation))
        setattr(parent, child, nn.Sequential(nn.ZeroPad2d((left, right, top, bottom)), plain))
    return fixed


def export_onnx(model: nn.Module, input_shape_chw: tuple[int, int, int], path: Path,
                output_names: Sequence[str] = CLASSIFIER_OUTPUT_NAMES) -> None:
    """`model` (eval, CPU) as an ONNX model at `path`: input `image` float32 [B, 3, H, W],
    outputs `output_names` (a classifier's `logits` float32 [B, C]); B dynamic.

    Exported by torch's TorchScript-based exporter, which traces the network once: 0.5 s for Lite0
    and for SSDlite's backbone and head, 1.6 s for SSD MobileNetV2's (its padding fixed first:
    `with_fixed_same_padding`), against 6.4, 9.8 and 8.8 s through torch.export (`dynamo=True`,
    torch 2.14's default); ONNX Runtime answers both graphs alike and as fast (docs/benchmarks.md,
    "The ONNX export"). torch 2.14 marks that exporter deprecated; where a later torch drops it,
    `dynamo=True` with a bounded batch dimension is the replacement."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using the legacy TorchScript-based ONNX export",
                                DeprecationWarning)
        warnings.filterwarnings("ignore", "The feature will be removed", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)     # as convert_openvino's trace
        # a fixed padding's slices, which it leaves for ONNX Runtime to fold
        warnings.filterwarnings("ignore", "Constant folding - Only steps=1", UserWarning)
        example = example_input(input_shape_chw)
        torch.onnx.export(with_fixed_same_padding(model, example), (example,), str(path), dynamo=False,
                          input_names=["image"], output_names=list(output_names),
                          dynamic_axes={name: {0: "batch"} for name in ("image", *output_names)})


def convert_openvino(model: nn.Module, input_shape_chw: tuple[int, int, int], path: Path) -> None:
    """`model` (eval, CPU) as an OpenVINO IR at `path` (`.xml`, weights in the `.bin` beside it)
    with input float32 [?, 3, S, S]. Weights stay fp32: compressed to fp16 they moved the bf16
    answers further from the fp32 model's (top-1 agreement on random inputs 0.875 vs 1.0)."""
    openvino = openvino_package()
    # OpenVINO traces the model with TorchScript, whose deprecation and tracer warnings are not
    # the user's to act on.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        converted = openvino.convert_model(model, example_input=example_input(input_shape_chw),
                                           input=[(-1, *input_shape_chw)])
    openvino.save_model(converted, str(path), compress_to_fp16=False)


@dataclass(frozen=True)
class EngineExports:
    models: tuple[EngineModel, ...] = ()
    int8_gate: Int8Gate | None = None      # the int8 model's gate, where one was built


def export_engine_models(model: nn.Module, request: CompileRequest, directory: Path,
                         output_names: Sequence[str] = CLASSIFIER_OUTPUT_NAMES) -> EngineExports:
    """The models `request.engines` asks for besides AOTInductor's (and the int8 OpenVINO model
    `request.int8` asks for), written into `directory` (relative names in the result are
    `directory.name/<file>`). int8_quantization.Int8GateFailed when the int8 model fails its gate."""
    model = model.eval().to(memory_format=torch.contiguous_format)
    built, gate = [], None
    if "openvino" in request.engines:
        convert_openvino(model, request.input_shape_chw, directory / OPENVINO_FILE)
        built.append(EngineModel("openvino", f"{directory.name}/{OPENVINO_FILE}"))
        if request.int8 is not None:
            gate = build_int8_model(model, directory / OPENVINO_FILE, request.int8)
            built.append(EngineModel("openvino", f"{directory.name}/{INT8_FILE}", "int8"))
    if "onnxruntime" in request.engines:
        export_onnx(model, request.input_shape_chw, directory / ONNX_FILE, output_names)
        built.append(EngineModel("onnxruntime", f"{directory.name}/{ONNX_FILE}"))
    return EngineExports(tuple(built), gate)


def export_detector_engines(network: nn.Module, request: CompileRequest, directory: Path) -> EngineExports:
    """An SSD-family detector's backbone and head (handlers.model.ssd_engine.SsdBackboneHead:
    outputs box regression and class logits) for `request.engines`, written into `directory`
    with the probe photos its workers check them on."""
    write_probe_photos(request, directory)
    return export_engine_models(SsdBackboneHead(network), request, directory, SSD_OUTPUT_NAMES)


def export_ultralytics_engines(export: Path, request: CompileRequest, directory: Path) -> EngineExports:
    """An Ultralytics TorchScript detection export as an OpenVINO IR (fp32, any batch) in
    `directory`, with the probe photos letterboxed as its workers letterbox them, on which they
    check it against the export (handlers.model.ultralytics_engine)."""
    directory.mkdir(parents=True, exist_ok=True)
    height, width = request.input_shape_chw[1:]
    images = [decode_image_bytes(photo_path(name).read_bytes(), ImageLimits()) for name in PROBE_PHOTOS]
    probe = torch.stack([ultralytics_letterboxed(image, (height, width), LETTERBOX_FILL)[0]
                         for image in images])
    torch.save(probe, directory.parent / PROBE_FILE)
    if "openvino" not in request.engines:
        return EngineExports()
    convert_openvino(torch.jit.load(str(export), map_location="cpu").eval(), request.input_shape_chw,
                     directory / OPENVINO_FILE)
    return EngineExports((EngineModel("openvino", f"{directory.name}/{OPENVINO_FILE}"),))
