"""Which runner a CPU worker tries first: runner names, CPU kinds, and the preference order per
kind that the archive records (pure; no engine is imported here).

A runner is an engine at a precision, named `<engine>-<precision>`: `aoti-bf16` (the archive's
AOTInductor package), `openvino-bf16` (its OpenVINO model compiled at worker start with that
inference precision), `onnxruntime-fp32`, `openvino-int8` (the archive's int8 OpenVINO model,
quantized and gated at build time; its layers left in float compute at the worker's precision).
The order is fixed when the archive is built, from lab figures (`torchserve-vision lab engines`
prints the order its measurements give on the CPU at hand); a worker never times anything. It
walks the order of its CPU's kind and serves the first runner it can run whose answers pass the
check (handlers/model/runner_selection.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

Engine = Literal["aoti", "openvino", "onnxruntime"]
ENGINES: tuple[str, ...] = get_args(Engine)
# What each engine does well on a CPU: bf16 only where it is native (AVX512-BF16 or AMX); ONNX
# Runtime's CPU provider computes fp32 (it has no bf16 convolutions); int8 from OpenVINO's own
# quantized model (any x86-64 CPU: VNNI where there is one).
ENGINE_PRECISIONS: Mapping[str, tuple[str, ...]] = {
    "aoti": ("fp32", "bf16"), "openvino": ("fp32", "bf16", "int8"), "onnxruntime": ("fp32",)}
# The weights an engine's model file holds: fp32 (compiled at worker start at fp32 or bf16) or
# int8 (quantized by the builder).
ENGINE_WEIGHTS = ("fp32", "int8")


def weights_for(precision: str) -> str:
    """The weights of the model file a runner at `precision` loads."""
    return "int8" if precision == "int8" else "fp32"

CpuKind = Literal["amx", "avx512_bf16", "avx512", "avx2"]
# The kind a missing entry of an order table falls back to: the next lesser CPU.
LESSER_KIND: Mapping[str, str] = {"amx": "avx512_bf16", "avx512_bf16": "avx512", "avx512": "avx2"}

# Measured with `torchserve-vision lab engines` (docs/benchmarks.md, "Engines" and "int8"),
# EfficientNet-Lite0 at the worker's 1 thread, batch 1 and 8, on a 2-core AMD EPYC Zen 4
# (AVX512-BF16, VNNI, no AMX): OpenVINO int8 (7-bit weights) 1.38x / 1.29x OpenVINO bf16, which
# is 1.53x / 1.06x the AOTInductor bf16 package (the same order at 2 threads); in fp32 ONNX
# Runtime 1.58x / 1.45x the fp32 package and 1.08x / 1.07x OpenVINO f32. The avx2 row is the order
# of a run held to AVX2 there (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2: torch's and
# OpenVINO's kernels; ONNX Runtime's cannot be held): int8 1.29x / 1.29x ONNX Runtime fp32. An
# int8 runner is tried only where the archive has its model (compile.int8, past its gate). amx and
# avx512 use the row below them until measured on such a CPU.
DEFAULT_RUNNER_ORDER: Mapping[str, tuple[str, ...]] = {
    "avx512_bf16": ("openvino-int8", "openvino-bf16", "aoti-bf16", "onnxruntime-fp32",
                    "openvino-fp32", "aoti-fp32"),
    "avx2": ("openvino-int8", "onnxruntime-fp32", "openvino-fp32", "aoti-fp32"),
}

# An SSD-family detector's backbone and head (handlers.model.ssd_engine). Measured with
# `torchserve-vision lab detector-parts` on SSDlite320 on a 2-core AMD EPYC with AVX2 only: ONNX
# Runtime 1.09x / 1.07x OpenVINO f32 at batch 1 / 4 on 1 thread, 1.11x / 1.10x on 2
# (docs/benchmarks.md, "Detector"); on the default detector (SSD MobileNetV2) on a Zen 4 with
# AVX512-BF16 the two f32 engines within 5% of each other, and OpenVINO bf16 1.78x / 2.02x ONNX
# Runtime at batch 1 / 4 on 1 thread. bf16 is tried only by a worker whose archive asks for
# `precision: bf16` (the default detector does; its scores move by up to 0.15: docs/precision.md,
# "Detectors in bf16") on a CPU with native bf16 (runner_selection.candidates).
DEFAULT_DETECTOR_RUNNER_ORDER: Mapping[str, tuple[str, ...]] = {
    "avx512_bf16": ("openvino-bf16", "onnxruntime-fp32", "openvino-fp32"),
    "avx2": ("onnxruntime-fp32", "openvino-fp32"),
}


# An Ultralytics TorchScript export's OpenVINO model, fp32 (the export itself serves when it is
# refused). Measured with `torchserve-vision lab ultralytics` on YOLOv8n at 640 on a 2-core AMD
# EPYC Zen 4 (AVX512-BF16, no AMX): 1.6-1.9x the TorchScript export (docs/benchmarks.md,
# "Ultralytics exports").
DEFAULT_ULTRALYTICS_RUNNER_ORDER: Mapping[str, tuple[str, ...]] = {"avx2": ("openvino-fp32",)}


@dataclass(frozen=True)
class RunnerName:
    engine: str
    precision: str

    def __str__(self) -> str:
        return f"{self.engine}-{self.precision}"


def parse_runner_name(text: str) -> RunnerName:
    """`<engine>-<precision>` -> RunnerName; ValueError naming what is allowed otherwise."""
    engine, _, precision = str(text).partition("-")
    if engine not in ENGINE_PRECISIONS or precision not in ENGINE_PRECISIONS[engine]:
        allowed = [f"{name}-{p}" for name, precisions in ENGINE_PRECISIONS.items() for p in precisions]
        raise ValueError(f"unknown runner {text!r}; runners are {allowed}")
    return RunnerName(engine, precision)


def parse_runner_order(table: Mapping[str, Sequence[str]]) -> dict[str, tuple[RunnerName, ...]]:
    """{cpu kind: [runner name, ...]} -> parsed; ValueError for an unknown kind or runner, a
    repeated runner, or a table without the `avx2` row (every x86-64-v3 CPU needs one)."""
    kinds = get_args(CpuKind)
    parsed: dict[str, tuple[RunnerName, ...]] = {}
    for kind, names in table.items():
        if kind not in kinds:
            raise ValueError(f"unknown CPU kind {kind!r}; kinds are {list(kinds)}")
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise ValueError(f"the order for {kind!r} must be a list of runner names, got {names!r}")
        runners = tuple(parse_runner_name(name) for name in names)
        if len(set(runners)) != len(runners):
            raise ValueError(f"the order for {kind!r} names a runner twice: {list(names)}")
        parsed[kind] = runners
    if "avx2" not in parsed:
        raise ValueError("the runner order needs an 'avx2' row (the kind every other falls back to)")
    return parsed


def cpu_kind(cpu_capability: str, features: frozenset[str] | None, native_bf16: bool) -> CpuKind:
    """The kind of this CPU for the order table: `native_bf16` (oneDNN computes bf16 in hardware)
    with AMX tiles -> amx, without -> avx512_bf16; else ATen's capability (lowered by
    `ATEN_CPU_CAPABILITY=avx2` to rehearse a lesser CPU) -> avx512 or avx2."""
    if native_bf16:
        return "amx" if features is not None and "amx_bf16" in features else "avx512_bf16"
    return "avx512" if cpu_capability == "AVX512" else "avx2"


def order_for(kind: str, table: Mapping[str, tuple[RunnerName, ...]]) -> tuple[RunnerName, ...]:
    """The order of `kind`, or of the nearest lesser kind the table has (`avx2` always is)."""
    while kind not in table:
        kind = LESSER_KIND.get(kind, "avx2")
    return table[kind]


def order_to_yaml(table: Mapping[str, tuple[RunnerName, ...]]) -> dict[str, list[str]]:
    return {kind: [str(runner) for runner in runners] for kind, runners in table.items()}
