"""Ahead-of-time compiled models: what a package was built for, whether this machine can run it,
and loading it safely.

`torchserve-vision build` compiles the model with AOTInductor into `.pt2` packages inside the
archive (one per precision), with one dynamic batch dimension 1..max_batch_size, and records
the target of each: torch version, device, CPU instruction set, precision, input shape. A worker
never compiles. At load it checks the recorded target against this machine, loads the package
(bounded in time), and checks its output against the eager model on a fixed probe batch; any
failure is logged with its reason and the worker serves the eager model, which is always
correct. So an archive built on one CPU is safe on another: at worst it runs eagerly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

Runner = Callable[[torch.Tensor], torch.Tensor]
RunnerKind = Literal["aot", "eager"]


@dataclass(frozen=True)
class CpuTarget:
    """The instruction set generated CPU kernels are built for: gcc's `-march`, Inductor's vector
    width, and the ATen CPU capability (`torch.backends.cpu.get_cpu_capability()`) a machine needs."""

    march: str
    simdlen: int
    capability: str


# avx2 runs on any x86-64-v3 CPU (Intel Haswell, AMD Zen and newer); avx512 needs x86-64-v4.
# oneDNN's convolutions and matrix products pick their kernels at run time either way (AMX too).
CPU_TARGETS = {
    "avx2": CpuTarget(march="x86-64-v3", simdlen=256, capability="AVX2"),
    "avx512": CpuTarget(march="x86-64-v4", simdlen=512, capability="AVX512"),
}
CAPABILITY_RANK = {"DEFAULT": 0, "NO AVX": 0, "AVX2": 1, "AVX512": 2}


@dataclass(frozen=True)
class CompileTarget:
    """What one compiled package was built for (recorded in the archive's YAML)."""

    torch_version: str
    device: str                 # "cpu" (CUDA packages must be built on a GPU machine)
    cpu_capability: str         # the least ATen CPU capability the kernels need, e.g. "AVX2"
    precision: str              # "fp32" | "bf16": the autocast dtype compiled into the graph
    max_batch_size: int         # the dynamic batch dimension's upper bound
    input_shape_chw: tuple[int, int, int]
    channels_last: bool

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["input_shape_chw"] = list(self.input_shape_chw)
        return record

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> CompileTarget:
        """Raises KeyError / TypeError / ValueError for a malformed record."""
        shape = tuple(int(side) for side in record["input_shape_chw"])
        if len(shape) != 3:
            raise ValueError(f"input_shape_chw must have 3 sides, got {shape}")
        return cls(str(record["torch_version"]), str(record["device"]), str(record["cpu_capability"]),
                   str(record["precision"]), int(record["max_batch_size"]),
                   (shape[0], shape[1], shape[2]), bool(record["channels_last"]))


@dataclass(frozen=True)
class CompiledPackage:
    """One `.pt2` file in the archive (path relative to the model directory) and its target."""

    file: str
    target: CompileTarget


@dataclass(frozen=True)
class MachineTarget:
    """What this worker offers: compared with a package's CompileTarget before loading it."""

    torch_version: str
    device: str
    cpu_capability: str
    precision: str              # the precision this worker runs (see model_loading.resolve_precision)

    @classmethod
    def here(cls, device: torch.device, precision: str) -> MachineTarget:
        return cls(str(torch.__version__), device.type, cpu_capability(), precision)


def cpu_capability() -> str:
    """ATen's CPU capability here: "AVX512", "AVX2" or "DEFAULT" (read from cpuinfo, no compile)."""
    return torch.backends.cpu.get_cpu_capability()


class CompiledModelRefused(RuntimeError):
    """A compiled package cannot serve on this worker. `kind` is a short stable name (a metric
    dimension): target, missing, load_failed, load_timeout, wrong_output; the message says why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def target_mismatch(target: CompileTarget, machine: MachineTarget) -> str | None:
    """Why a package built for `target` must not run on `machine`, or None when it may."""
    if target.torch_version != machine.torch_version:
        return f"built with torch {target.torch_version}, this worker has {machine.torch_version}"
    if target.device != machine.device:
        return f"built for {target.device}, this worker runs on {machine.device}"
    if target.device == "cpu":
        needed = CAPABILITY_RANK.get(target.cpu_capability)
        offered = CAPABILITY_RANK.get(machine.cpu_capability, 0)
        if needed is None or offered < needed:
            return (f"built for CPU capability {target.cpu_capability}, this CPU has "
                    f"{machine.cpu_capability}")
    if target.precision != machine.precision:
        return f"built for {target.precision}, this worker runs {machine.precision}"
    return None


def package_for(packages: Sequence[CompiledPackage], machine: MachineTarget) -> CompiledPackage:
    """The package this machine can run: the one of its precision whose target fits."""
    same_precision = [package for package in packages if package.target.precision == machine.precision]
    if not same_precision:
        raise CompiledModelRefused("target", f"no compiled package for {machine.precision} "
                                   f"(the archive has {[p.target.precision for p in packages]})")
    reasons = [target_mismatch(package.target, machine) for package in same_precision]
    for package, reason in zip(same_precision, reasons, strict=True):
        if reason is None:
            return package
    raise CompiledModelRefused("target", "; ".join(reason for reason in reasons if reason))


class ChunkedRunner:
    """A compiled model whose batch dimension is bounded: larger batches (a batch size raised
    through the management API after the build) run in chunks of at most `max_batch_size`."""

    def __init__(self, compiled: Runner, max_batch_size: int) -> None:
        self.compiled = compiled
        self.max_batch_size = max_batch_size

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if batch.shape[0] <= self.max_batch_size:
            return self.compiled(batch)
        return torch.cat([self.compiled(chunk) for chunk in batch.split(self.max_batch_size)])


def load_aoti_package(path: Path) -> Runner:
    """Load an AOTInductor package. Inductor would first compile a small probe program to find
    the CPU's vector ISA; the package is already built, so that probe is skipped."""
    import torch._inductor
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        return torch._inductor.aoti_load_package(str(path))


def call_with_deadline(function: Callable[[], Runner], timeout_s: float) -> Runner:
    """`function()` in a daemon thread; CompiledModelRefused when it raises or takes longer than
    `timeout_s` (the thread is then abandoned, and its result ignored)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["runner"] = function()
        except Exception as error:  # noqa: BLE001 - any failure means: serve eagerly
            outcome["error"] = error

    thread = threading.Thread(target=target, name="compiled-model-load", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CompiledModelRefused("load_timeout", f"loading took longer than {timeout_s:g} s")
    if "error" in outcome:
        error = outcome["error"]
        raise CompiledModelRefused("load_failed", f"loading failed: {type(error).__name__}: {error}")
    return outcome["runner"]


def probe_batch(target: CompileTarget, device: torch.device) -> torch.Tensor:
    """A fixed pseudo-random batch of 2 in the package's input layout."""
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(2, *target.input_shape_chw, generator=generator).to(device)
    return batch.contiguous(memory_format=torch.channels_last) if target.channels_last else batch


def check_against_eager(compiled: Runner, eager: Runner, probe: torch.Tensor, precision: str) -> None:
    """CompiledModelRefused when the compiled output differs from the eager model's on `probe`
    by more than the precision allows (relative to the output's largest magnitude)."""
    with torch.inference_mode():
        expected = eager(probe).float()
        got = compiled(probe).float()
    if got.shape != expected.shape:
        raise CompiledModelRefused("wrong_output", f"output shape {tuple(got.shape)}, "
                                                   f"eager {tuple(expected.shape)}")
    tolerance = (1e-3 if precision == "fp32" else 5e-2) * max(1.0, expected.abs().max().item())
    difference = (got - expected).abs().max().item()
    if not difference <= tolerance:  # also catches NaN
        raise CompiledModelRefused("wrong_output", f"output differs from the eager model by {difference:.3g} "
                                   f"(allowed {tolerance:.3g})")


def load_compiled_runner(packages: Sequence[CompiledPackage], model_dir: Path, machine: MachineTarget,
                         eager: Runner, timeout_s: float) -> ChunkedRunner:
    """The compiled package this worker can run, loaded within `timeout_s` and checked against
    `eager`; CompiledModelRefused with the reason otherwise."""
    package = package_for(packages, machine)
    path = model_dir / package.file
    if not path.is_file():
        raise CompiledModelRefused("missing", f"{package.file} is not in the archive")
    compiled = call_with_deadline(lambda: load_aoti_package(path), timeout_s)
    check_against_eager(compiled, eager, probe_batch(package.target, torch.device(machine.device)),
                        machine.precision)
    return ChunkedRunner(compiled, package.target.max_batch_size)


def compiled_or_eager(packages: Sequence[CompiledPackage], model_dir: Path, machine: MachineTarget,
                      eager: Runner, timeout_s: float
                      ) -> tuple[Runner, RunnerKind, CompiledModelRefused | None]:
    """(runner, kind, refusal): the compiled model when it may run here, else `eager` with the
    refusal that says why (logged). No packages: eager, no refusal."""
    if not packages:
        return eager, "eager", None
    try:
        return load_compiled_runner(packages, model_dir, machine, eager, timeout_s), "aot", None
    except CompiledModelRefused as refusal:
        logger.warning("compiled model refused (%s), serving the eager model: %s", refusal.kind,
                       refusal)
        return eager, "eager", refusal
