"""Ahead-of-time compiled models: what a package was built for, whether this machine can run it,
and loading it safely.

`torchserve-vision build` compiles the model with AOTInductor into `.pt2` packages inside the
archive (one per precision), with one dynamic batch dimension 1..max_batch_size, and records
the target of each: torch version, device, CPU instruction set, precision, input shape. A worker
never compiles. At load it checks the recorded target against this machine (ATen's CPU
capability and every feature of the target's x86-64 level), loads the package (bounded in time,
with input checks on), and checks its answers to the archive's probe photos against the fp32
eager model's with the criterion of handlers.model.answer_agreement. Any failure refuses the
package with its reason (CompiledModelRefused); handlers.model.runner_selection then tries the next
runner of the archive's order, and serves the eager model, always correct, when none is left. So
an archive built on one CPU is safe on another: at worst it runs eagerly.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from handlers.model.answer_agreement import answer_disagreement, probability_bound, top_classes
from handlers.model.gil_free_package import GilFreePackage, UnsupportedPackage

logger = logging.getLogger(__name__)

Runner = Callable[[torch.Tensor], torch.Tensor]
Result = TypeVar("Result")


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

# What gcc's x86-64 levels let generated code use, as /proc/cpuinfo names the features (LZCNT is
# "abm" there). ATen's "AVX2" asks for less (AVX2 and FMA), and a VM may hide the rest: code built
# for x86-64-v3 on such a CPU dies with an illegal instruction, so a worker checks them all.
_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
X86_64_LEVEL_FEATURES = {
    "x86-64-v3": _X86_64_V3,
    "x86-64-v4": _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}


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
    cpu_features: frozenset[str] | None = None   # /proc/cpuinfo's flags; None: unknown

    @classmethod
    def here(cls, device: torch.device, precision: str) -> MachineTarget:
        return cls(str(torch.__version__), device.type, cpu_capability(), precision, cpu_features())


def cpu_capability() -> str:
    """ATen's CPU capability here: "AVX512", "AVX2" or "DEFAULT" (read from cpuinfo, no compile).
    `ATEN_CPU_CAPABILITY=avx2` lowers it (to rehearse an AVX2 machine on an AVX-512 one)."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The CPU's feature flags as the kernel reports them (the first `flags` line), or None where
    there is no such file (not Linux)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return None


def missing_cpu_features(capability: str, features: frozenset[str] | None) -> str | None:
    """Why code built for the CPU target of ATen `capability` cannot run on a CPU with `features`
    (the features it lacks, or that they are unknown), or None when it can."""
    marches = [target.march for target in CPU_TARGETS.values() if target.capability == capability]
    if not marches:
        return None  # no target of ours asks for this capability: the rank check decides
    needed = X86_64_LEVEL_FEATURES[marches[0]]
    if features is None:
        return f"the CPU's features cannot be read, and {marches[0]} code needs {sorted(needed)}"
    missing = sorted(needed - features)
    return f"this CPU lacks {missing}, which {marches[0]} code needs" if missing else None


class CompiledModelRefused(RuntimeError):
    """A compiled package cannot serve on this worker. `kind` is a short stable name (a metric
    dimension): target, cpu_features, missing, load_failed, load_timeout, wrong_output; the
    message says why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def target_mismatch(target: CompileTarget, machine: MachineTarget) -> CompiledModelRefused | None:
    """Why a package built for `target` must not run on `machine`, or None when it may."""
    if target.torch_version != machine.torch_version:
        return CompiledModelRefused("target", f"built with torch {target.torch_version}, this "
                                    f"worker has {machine.torch_version}")
    if target.device != machine.device:
        return CompiledModelRefused("target", f"built for {target.device}, this worker runs on "
                                    f"{machine.device}")
    if target.precision != machine.precision:
        return CompiledModelRefused("target", f"built for {target.precision}, this worker runs "
                                    f"{machine.precision}")
    if target.device == "cpu":
        needed = CAPABILITY_RANK.get(target.cpu_capability)
        offered = CAPABILITY_RANK.get(machine.cpu_capability, 0)
        if needed is None or offered < needed:
            return CompiledModelRefused("target", f"built for CPU capability {target.cpu_capability}, "
                                        f"this CPU has {machine.cpu_capability}")
        missing = missing_cpu_features(target.cpu_capability, machine.cpu_features)
        if missing is not None:
            return CompiledModelRefused("cpu_features", missing)
    return None


def package_for(packages: Sequence[CompiledPackage], machine: MachineTarget) -> CompiledPackage:
    """The package this machine can run: of its precision, the richest CPU target that fits (an
    archive may hold one package per target). When none fits, CompiledModelRefused with every
    reason, of the kind of the least demanding package's misfit."""
    same_precision = [package for package in packages if package.target.precision == machine.precision]
    if not same_precision:
        raise CompiledModelRefused("target", f"no compiled package for {machine.precision} "
                                   f"(the archive has {[p.target.precision for p in packages]})")
    richest_first = sorted(same_precision, reverse=True,
                           key=lambda package: CAPABILITY_RANK.get(package.target.cpu_capability, -1))
    refusals = []
    for package in richest_first:
        refusal = target_mismatch(package.target, machine)
        if refusal is None:
            return package
        refusals.append(refusal)
    raise CompiledModelRefused(refusals[-1].kind, "; ".join(str(refusal) for refusal in refusals))


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


class IsaMismatchWarningFilter(logging.Filter):
    """Drops AOTInductor's load-time warning that a package's CPU ISA differs from this CPU's
    (e.g. "AVX512 AVX512_VNNI vs AVX2"): a package built for a lesser target than the CPU offers
    is what the archive builder means to ship, and `target_mismatch` decides what may run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.args, tuple) and record.args[:1] == ("AOTI_CPU_ISA",))


ISA_MISMATCH_WARNING_FILTER = IsaMismatchWarningFilter()


def load_aoti_package(path: Path, device: str = "cpu") -> Runner:
    """Load an AOTInductor package whose every call checks its input's shape, strides and dtype
    against what it was built for, and raises on a mismatch. Without the check (AOTInductor's
    default) a package fed another shape reads out of bounds: wrong numbers, or a crash. It costs
    microseconds per call; `AOTI_RUNTIME_CHECK_INPUTS` is read once per package, at its first
    call, so it is set for the whole worker process.

    A CPU package runs through its C interface with the GIL released (GilFreePackage), so the
    worker's other threads go on while a batch runs; one that cannot (logged) and a CUDA package
    (whose run only launches kernels) load with torch's loader. Inductor would also compile a
    small probe program to find the CPU's vector ISA; the package is already built, so that is
    skipped."""
    import torch._inductor
    import torch._inductor.config as inductor_config

    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    if device == "cpu":
        try:
            return GilFreePackage(path)
        except UnsupportedPackage as reason:
            logger.warning("%s runs with torch's loader, which holds the GIL: %s", path.name, reason)
    logging.getLogger("torch.export.pt2_archive._package").addFilter(ISA_MISMATCH_WARNING_FILTER)
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        return torch._inductor.aoti_load_package(str(path))


def call_with_deadline(function: Callable[[], Result], timeout_s: float) -> Result:
    """`function()` in a daemon thread; CompiledModelRefused when it raises or takes longer than
    `timeout_s` (the thread is then abandoned, and its result ignored)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = function()
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
    result: Result = outcome["result"]
    return result


COMPILED_DIRECTORY = "compiled"   # in the model directory: the packages and their probe photos
PROBE_FILE = f"{COMPILED_DIRECTORY}/probe-photos.pt"   # written by the archive builder
PROBE_TOP_K = 10


def load_probe_photos(model_dir: Path) -> torch.Tensor:
    """The archive's probe: `uint8[N, 3, S, S]` real photos, resized and centre-cropped to the
    model's input at build time. CompiledModelRefused("missing") when the archive has none."""
    path = model_dir / PROBE_FILE
    if not path.is_file():
        raise CompiledModelRefused("missing", f"{PROBE_FILE} is not in the archive")
    return torch.load(path, map_location="cpu", weights_only=True)


def reference_answers(reference: Runner, probe: torch.Tensor) -> torch.Tensor:
    """The fp32 eager model's probabilities for the probe photos (`probe`, its input): what
    check_answers compares a package's with. A worker computes them once, however many loads and
    candidates it checks."""
    with torch.inference_mode():
        return reference(probe).float().softmax(dim=1)


def check_answers(compiled: Runner, expected: torch.Tensor, probe: torch.Tensor, *precisions: str) -> None:
    """CompiledModelRefused("wrong_output") unless the compiled model's answer to every probe photo
    agrees with the fp32 eager model's (`expected`: reference_answers) within what `precisions`
    allow (the loosest) (handlers.model.answer_agreement: the criterion the tests use too). A
    package that fails to run on the probe is refused as well."""
    with torch.inference_mode():
        try:
            got = compiled(probe).float()
        except Exception as error:  # noqa: BLE001 - a package that cannot run the probe is refused
            raise CompiledModelRefused("wrong_output", f"running the probe photos failed: "
                                       f"{type(error).__name__}: {error}") from None
    if got.shape != expected.shape:
        raise CompiledModelRefused("wrong_output", f"output shape {tuple(got.shape)}, "
                                                   f"eager {tuple(expected.shape)}")
    bound = probability_bound(*precisions)
    for photo, (row, expected_row) in enumerate(zip(got.softmax(dim=1), expected, strict=True)):
        reason = answer_disagreement(top_classes(row, PROBE_TOP_K),
                                     top_classes(expected_row, PROBE_TOP_K), bound)
        if reason is not None:
            raise CompiledModelRefused("wrong_output", f"probe photo {photo} answered differently "
                                       f"from the fp32 eager model: {reason}")


@dataclass(frozen=True)
class EagerModel:
    """The eager network a package stands in for: `serve` (at the worker's precision; served when
    the package is refused), `fp32` (the reference answers), `model_input` (the archive's
    `uint8[N, 3, S, S]` probe photos -> the network's normalized input)."""

    serve: Runner
    fp32: Runner
    model_input: Callable[[torch.Tensor], torch.Tensor]
