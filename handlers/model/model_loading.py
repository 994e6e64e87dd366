"""Build the network an archive describes and put it on the worker's device."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from handlers.model.settings import STATE_DICT_SOURCES, HandlerSettings, ModelSource

logger = logging.getLogger(__name__)


def resolve_device(gpu_id: int | None) -> torch.device:
    """`cuda:<gpu_id>` when TorchServe gave this worker a GPU and CUDA works, else the CPU."""
    if gpu_id is not None and torch.cuda.is_available():
        return torch.device(f"cuda:{gpu_id}")
    return torch.device("cpu")


def is_torchvision_detector(architecture: str) -> bool:
    import torchvision

    return architecture in torchvision.models.list_models(module=torchvision.models.detection)


def create_architecture(source: ModelSource) -> nn.Module:
    """An untrained timm, torchvision or project network of the named architecture."""
    if source.architecture is None:
        raise ValueError(f"source '{source.source}' needs an architecture name")
    kwargs: dict[str, Any] = dict(source.builder_kwargs)
    if source.num_classes is not None:
        kwargs["num_classes"] = source.num_classes
    if source.source == "timm":
        import timm

        return timm.create_model(source.architecture, pretrained=False, **kwargs)
    if source.source == "torchvision":
        import torchvision

        if is_torchvision_detector(source.architecture):
            kwargs["weights_backbone"] = None  # the builder's default would download ImageNet weights
        return torchvision.models.get_model(source.architecture, weights=None, **kwargs)
    if source.source == "project":
        from handlers.model.project_architectures import create_project_architecture

        return create_project_architecture(source.architecture, **kwargs)
    raise ValueError(f"source '{source.source}' has no architecture to create")


def load_state_dict_model(source: ModelSource, weights_path: Path) -> nn.Module:
    """The architecture with the state dict at `weights_path` loaded strictly (every key, every
    shape). The architecture is built without memory on the meta device and takes the loaded
    tensors as they are: its random initialisation, which the state dict overwrites anyway, is
    skipped (ssd300_vgg16's is 1.4 s of a worker's start on one AMX Xeon core). An architecture
    that cannot be built so, or that keeps a tensor the state dict does not hold (a buffer left
    out of it), is built and initialised as usual."""
    state_dict = torch.load(weights_path, map_location="cpu", weights_only=True)
    model = built_from_state_dict(source, state_dict)
    if model is not None:
        return model
    model = create_architecture(source)
    model.load_state_dict(state_dict, strict=True)
    return model


def built_from_state_dict(source: ModelSource, state_dict: dict[str, torch.Tensor]) -> nn.Module | None:
    """`source`'s architecture built on the meta device with `state_dict`'s tensors assigned
    (strictly); None when it cannot be built so or a tensor is left on the meta device."""
    try:
        with torch.device("meta"):
            model = create_architecture(source)
    except (NotImplementedError, RuntimeError, ValueError, TypeError):
        return None
    model.load_state_dict(state_dict, strict=True, assign=True)
    tensors = [*model.parameters(), *model.buffers()]
    if any(tensor.is_meta for tensor in tensors):
        return None
    return model


def load_model(source: ModelSource, weights_path: Path, device: torch.device) -> nn.Module:
    """Load the archive's network in eval mode on `device`.

    timm / torchvision / project: architecture by name plus a state dict; torchscript: `torch.jit.save`
    output; export: `torch.export.save` output (an ExportedProgram, run via `.module()`);
    ultralytics: an Ultralytics export, TorchScript, or ONNX (a `.onnx` file: run by ONNX Runtime,
    handlers.model.onnx_program).
    """
    if source.source == "ultralytics" and weights_path.suffix == ".onnx":
        from handlers.model.onnx_program import OnnxProgram

        model: nn.Module = OnnxProgram(weights_path, device, torch.get_num_threads())
    elif source.source in STATE_DICT_SOURCES:
        model = load_state_dict_model(source, weights_path)
    elif source.source in ("torchscript", "ultralytics"):
        model = torch.jit.load(str(weights_path), map_location="cpu")
    elif source.source == "export":
        model = torch.export.load(str(weights_path)).module()
    else:
        raise ValueError(f"unknown model source '{source.source}'")
    model = model.to(device)
    if source.source != "export":  # exported programs have no train/eval switch
        model.eval()
    return model


AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def cpu_has_native_bf16() -> bool:
    """This CPU computes bf16 in hardware (AVX512-BF16 or AMX) and oneDNN may use it for bf16
    convolutions and matrix products (not so under `ONEDNN_MAX_CPU_ISA=AVX2`, which rehearses an
    AVX2-only CPU). Elsewhere bf16 is emulated, slower than fp32, or not available to oneDNN."""
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(hardware and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def effective_precision(precision: str, device: torch.device, native_cpu_bf16: bool) -> str:
    """The precision a worker runs: fp16 / bf16 / tf32 on CUDA; on the CPU bf16 where the CPU has
    native bf16, and fp32 for everything else (fp16 and tf32 on a CPU, bf16 on a CPU without it)."""
    if device.type == "cuda" or precision == "fp32":
        return precision
    return "bf16" if precision == "bf16" and native_cpu_bf16 else "fp32"


def resolve_precision(precision: str, device: torch.device) -> str:
    """`effective_precision` on this machine; logs when the asked precision cannot apply."""
    effective = effective_precision(precision, device, device.type == "cpu" and cpu_has_native_bf16())
    if effective != precision:
        logger.warning("precision=%s cannot run natively on %s; running %s", precision, device,
                       effective)
    return effective


def use_tensor_float_32(device: torch.device, precision: str) -> None:
    """On CUDA, whether cuDNN convolutions and cuBLAS matrix products may round float32 inputs to
    TF32 (10 significant bits): only under `tf32`; every other precision's float32 work (all of
    fp32's, and what autocast leaves in float32) is IEEE float32. PyTorch lets cuDNN use TF32 by
    default, which moved EfficientNet-Lite0's fp32 probabilities by up to 0.0049 against the
    CPU's on an H200. The flags are the process's: set once, when a worker loads its network
    (`load_for_serving`), never around a forward pass, where a change would race with any other
    thread of the process. A worker that loads two networks (a pipeline's stages) runs both at
    the setting of the last one loaded. The project's own float32 work on the device (the
    fixed-point resize) computes where the setting does not matter."""
    if device.type == "cuda":
        allowed = precision == "tf32"
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = allowed


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The arithmetic of an effective precision (see `resolve_precision`) for a forward pass:
    autocast to fp16 / bf16 on the device; fp32 and tf32 without autocast (float32 work on CUDA
    as `use_tensor_float_32` set it when the network was loaded)."""
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


def load_labels(path: Path) -> list[str]:
    """Class names from a JSON list (index = class index) or a text file with one name per line."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        labels = json.loads(text)
        if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
            raise ValueError(f"{path} must hold a JSON list of class names")
        return labels
    return [line.strip() for line in text.splitlines() if line.strip()]


def load_for_serving(settings: HandlerSettings, model_dir: Path, serialized_file: str,
                     device: torch.device) -> tuple[list[str], str, nn.Module]:
    """(class names, the precision that runs on `device`, the network on `device` in eval mode)
    of one model directory: what every served model loads first."""
    labels = load_labels(model_dir / settings.labels_file)
    precision = resolve_precision(settings.precision, device)
    use_tensor_float_32(device, precision)
    return labels, precision, load_model(settings.model, model_dir / serialized_file, device)
