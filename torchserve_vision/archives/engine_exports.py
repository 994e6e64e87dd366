"""A classifier for the engines beside AOTInductor, for the archive builder: an ONNX model (ONNX
Runtime) and an OpenVINO IR, each with a dynamic batch dimension and fp32 weights (the precision
is chosen where the model is compiled, at worker start: handlers/model/engine_runners.py).

Measured on a 2-core AMD EPYC (Zen 4), EfficientNet-Lite0: the OpenVINO conversion takes about
2 s, the ONNX export about 7 s; each adds one copy of the weights to the archive
(docs/benchmarks.md, "Engines").
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from handlers.model.runner_selection import EngineModel

ONNX_FILE = "model.onnx"
OPENVINO_FILE = "model-openvino.xml"   # and model-openvino.bin beside it


def example_input(input_shape_chw: tuple[int, int, int]) -> torch.Tensor:
    # Batch 2: a dimension exported from an example of size 1 would be specialised to 1.
    return torch.zeros(2, *input_shape_chw)


def export_onnx(model: nn.Module, input_shape_chw: tuple[int, int, int], max_batch_size: int,
                path: Path) -> None:
    """`model` (eval, CPU) as an ONNX model at `path`: input `image` float32 [B, 3, S, S],
    output `logits` float32 [B, C]; B dynamic. The batch bound is what torch.export needs to
    trace; ONNX Runtime runs any batch size."""
    program = torch.onnx.export(model, (example_input(input_shape_chw),), dynamo=True,
                                input_names=["image"], output_names=["logits"], verbose=False,
                                dynamic_shapes=({0: torch.export.Dim("batch", min=1,
                                                                     max=max(max_batch_size, 2))},))
    if program is None:
        raise RuntimeError("torch.onnx.export returned no program")
    program.save(str(path))


def convert_openvino(model: nn.Module, input_shape_chw: tuple[int, int, int], path: Path) -> None:
    """`model` (eval, CPU) as an OpenVINO IR at `path` (`.xml`, weights in the `.bin` beside it)
    with input float32 [?, 3, S, S]. Weights stay fp32: compressed to fp16 they moved the bf16
    answers further from the fp32 model's (top-1 agreement on random inputs 0.875 vs 1.0)."""
    import openvino

    # OpenVINO traces the model with TorchScript, whose deprecation and tracer warnings are not
    # the user's to act on.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        converted = openvino.convert_model(model, example_input=example_input(input_shape_chw),
                                           input=[(-1, *input_shape_chw)])
    openvino.save_model(converted, str(path), compress_to_fp16=False)


def export_engine_models(model: nn.Module, engines: tuple[str, ...], input_shape_chw: tuple[int, int, int],
                         max_batch_size: int, directory: Path) -> list[EngineModel]:
    """The models `engines` asks for besides AOTInductor's, written into `directory` (relative
    names in the result are `directory.name/<file>`)."""
    model = model.eval().to(memory_format=torch.contiguous_format)
    built = []
    if "openvino" in engines:
        convert_openvino(model, input_shape_chw, directory / OPENVINO_FILE)
        built.append(EngineModel("openvino", f"{directory.name}/{OPENVINO_FILE}"))
    if "onnxruntime" in engines:
        export_onnx(model, input_shape_chw, max_batch_size, directory / ONNX_FILE)
        built.append(EngineModel("onnxruntime", f"{directory.name}/{ONNX_FILE}"))
    return built
