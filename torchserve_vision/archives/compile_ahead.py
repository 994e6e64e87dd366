"""Compile a classifier ahead of time with AOTInductor, for the archive builder (the other engines'
models: engine_exports.py).

One `.pt2` package per precision the archive may run on a CPU (fp32 always; bf16 too when the
model asks for it, for CPUs with native bf16), each with a dynamic batch dimension 1..max batch
size, Inductor freezing (batch norms folded, oneDNN weights pre-packed) and generated kernels for
a named CPU target (`handlers.model.compiled_model.CPU_TARGETS`), not for the build machine: an
archive built on an AVX-512 host runs on an AVX2 one. Workers load a package and never compile
(see handlers/model/compiled_model.py for the checks made at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from handlers.ground.limits import ImageLimits
from handlers.model.compiled_model import CPU_TARGETS, PROBE_FILE, CompiledPackage, CompileTarget
from handlers.model.model_loading import AUTOCAST_DTYPES
from handlers.request.decode import decode_image_bytes
from handlers.task.transforms import resize_and_center_crop
from torchserve_vision.archives.int8_quantization import Int8Request
from torchserve_vision.photos import PROBE_PHOTOS, photo_path


@dataclass(frozen=True)
class CompileRequest:
    """What to build: the model's input and the precisions and CPU target of its packages."""

    precision: str                  # the model's asked precision: fp32 | fp16 | bf16
    cpu_target: str                 # a key of CPU_TARGETS
    max_batch_size: int
    input_shape_chw: tuple[int, int, int]
    channels_last: bool
    resize_size: int                # the classifier's resize before its centre crop (probe photos)
    engines: tuple[str, ...] = ("aoti",)   # runner_order.ENGINES: what to build
    int8: Int8Request | None = None        # an int8 OpenVINO model too (engines has openvino)


class AutocastForward(nn.Module):
    """`model` under CPU autocast to `dtype`, so the exported graph computes in that precision."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.dtype):
            return self.model(batch)


def without_inplace_activations(model: nn.Module) -> nn.Module:
    """`model` with every in-place activation (ReLU6, ReLU, Hardswish, ... built with
    `inplace=True`) made out-of-place, for export: the answers are the same, and the in-place
    ops' decompositions under a dynamic batch are what tracing spends most on (EfficientNet-Lite0's
    AOTInductor packages, fp32 and bf16, in 37.6 s instead of 44.2 on one AMX Xeon core;
    docs/benchmarks.md, "Building the archives: in-place activations made out-of-place")."""
    for module in model.modules():
        if getattr(module, "inplace", None) is True:
            setattr(module, "inplace", False)  # noqa: B010 - an attribute of some module types only
    return model


def cpu_precisions(precision: str) -> list[str]:
    """The precisions a CPU worker may run for an asked precision (model_loading.effective_precision):
    fp32 everywhere, bf16 where the CPU has it natively."""
    return ["fp32", "bf16"] if precision == "bf16" else ["fp32"]


def example_batch(request: CompileRequest) -> torch.Tensor:
    # Batch 2: a dimension exported from an example of size 1 would be specialised to 1.
    batch = torch.zeros(2, *request.input_shape_chw)
    return batch.contiguous(memory_format=torch.channels_last) if request.channels_last else batch


def inductor_configs(cpu_target: str) -> dict[str, Any]:
    """Freezing, the named CPU target, and input checks that accept batch 1: torch.export records
    a dynamic dimension as 2..max (sizes 0 and 1 are specialised away while tracing), but the
    generated code is the same for 1, which the tests check against the eager model."""
    target = CPU_TARGETS[cpu_target]
    return {"freezing": True, "cpp.march": target.march, "cpp.simdlen": target.simdlen,
            "aot_inductor.check_lowerbound": False}


def compile_package(model: nn.Module, request: CompileRequest, precision: str, path: Path) -> CompiledPackage:
    """Export `model` (eval, on the CPU) with a dynamic batch and build one package at `path`
    (relative names in the result are `path.parent.name/path.name`)."""
    import torch._inductor

    forward = model if precision == "fp32" else AutocastForward(model, AUTOCAST_DTYPES[precision])
    batch_dim = torch.export.Dim("batch", min=1, max=request.max_batch_size)
    # Inductor freezes (folds batch norms, pre-packs oneDNN weights) only with gradients off:
    # measured 112 ms vs 143 ms for batch 8 on one AVX2 core.
    with torch.no_grad():
        program = torch.export.export(forward, (example_batch(request),),
                                      dynamic_shapes=({0: batch_dim},))
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs=inductor_configs(request.cpu_target))
    target = CompileTarget(str(torch.__version__), "cpu", CPU_TARGETS[request.cpu_target].capability,
                           precision, request.max_batch_size, request.input_shape_chw,
                           request.channels_last)
    return CompiledPackage(f"{path.parent.name}/{path.name}", target)


def probe_photos(resize_size: int, input_size: int) -> torch.Tensor:
    """`uint8[N, 3, input_size, input_size]`: the probe photos (photos.PROBE_PHOTOS), decoded,
    resized and centre-cropped as the classifier's worker does."""
    images = [decode_image_bytes(photo_path(name).read_bytes(), ImageLimits()) for name in PROBE_PHOTOS]
    return torch.stack([resize_and_center_crop(image, resize_size, input_size) for image in images])


def write_probe_photos(request: CompileRequest, directory: Path) -> None:
    """The probe photos at the model's input size, beside `directory` (made if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(probe_photos(request.resize_size, request.input_shape_chw[1]),
               directory.parent / PROBE_FILE)


def compile_packages(model: nn.Module, request: CompileRequest, directory: Path) -> list[CompiledPackage]:
    """Every package `request` asks for, written into `directory`, with the probe photos a worker
    checks a compiled model's answers on before it serves it
    (handlers.model.compiled_model.check_answers); none when `aoti` is not among its engines."""
    write_probe_photos(request, directory)
    if "aoti" not in request.engines:
        return []
    model = model.eval()
    if request.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return [compile_package(model, request, precision, directory / f"model-{precision}.pt2")
            for precision in cpu_precisions(request.precision)]
