"""Which runner serves a classifier (or an SSD-family detector's backbone and head) on this
worker: the first of the archive's order for this CPU's kind that this worker can run and whose
answers pass the check, else the eager network.

A candidate is skipped (not tried) when its precision is not one this worker may run (bf16 where
the CPU has no native bf16, or the model did not ask for it) or when the archive has no model
for it. A candidate that is tried and fails (a package built for another CPU, an engine that
will not load in time, answers to the probe photos that the criterion of
handlers.model.answer_agreement refuses at the runner's precision) is refused with its reason,
logged, and the next one is tried. The eager network, always correct, serves when none passes.
A detector's check compares every anchor's scores and box with the eager network's
(handlers.model.ssd_engine.check_head_outputs), at the same bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.model.compiled_model import (
    ChunkedRunner,
    CompiledModelRefused,
    CompiledPackage,
    EagerModel,
    MachineTarget,
    Result,
    Runner,
    call_with_deadline,
    check_answers,
    load_aoti_package,
    load_probe_photos,
    package_for,
    reference_answers,
)
from handlers.model.engine_runners import OnnxRuntimeRunner, OpenVinoRunner, openvino_cache_dir
from handlers.model.host_batches import SoloThreadsRunner, host_batches, loads_of
from handlers.model.runner_order import (
    DEFAULT_RUNNER_ORDER,
    RunnerName,
    cpu_kind,
    order_for,
    parse_runner_order,
    weights_for,
)
from handlers.model.ssd_engine import BackboneHeadRunner, check_head_outputs, probe_head_reference
from handlers.model.ultralytics_engine import check_outputs, probe_outputs

logger = logging.getLogger(__name__)
EAGER = "eager"


@dataclass(frozen=True)
class EngineModel:
    """A model file for an engine other than AOTInductor (`openvino`: the IR's `.xml`, its `.bin`
    beside it; `onnxruntime`: the `.onnx`), relative to the model directory, with the weights it
    holds (runner_order.ENGINE_WEIGHTS)."""

    engine: str
    file: str
    weights: str = "fp32"


@dataclass(frozen=True)
class ArchiveRunners:
    """What an archive offers a CPU worker: AOTInductor packages, other engines' models, and the
    preference order per CPU kind (runner_order; None: the project's DEFAULT_RUNNER_ORDER)."""

    packages: tuple[CompiledPackage, ...] = ()
    engine_models: tuple[EngineModel, ...] = ()
    order: Mapping[str, tuple[RunnerName, ...]] | None = None

    def __bool__(self) -> bool:
        return bool(self.packages or self.engine_models)

    def order_table(self) -> Mapping[str, tuple[RunnerName, ...]]:
        return self.order if self.order is not None else parse_runner_order(DEFAULT_RUNNER_ORDER)

    def engine_file(self, engine: str, precision: str) -> str | None:
        """The file of `engine`'s model a runner at `precision` loads, or None."""
        weights = weights_for(precision)
        return next((model.file for model in self.engine_models
                     if model.engine == engine and model.weights == weights), None)


@dataclass(frozen=True)
class Refusal:
    runner: str
    error: CompiledModelRefused


@dataclass(frozen=True)
class RunnerChoice:
    """What serves a network: `runner` ("openvino-bf16", "aoti-fp32", ..., or "eager"), its file,
    the CPU kind whose order was walked, and the candidates refused on the way."""

    runner: str
    precision: str
    file: str | None = None
    cpu_kind: str | None = None
    refusals: tuple[Refusal, ...] = ()
    package: CompiledPackage | None = None
    solo_threads: int | None = None   # loaded again at this many threads (host_batches)

    @property
    def computes_in_torch(self) -> bool:
        """The eager network or an AOTInductor package (torch's threads compute), not another
        engine (which computes on threads of its own)."""
        return self.runner == EAGER or self.runner.startswith("aoti-")

    def describe(self) -> dict[str, Any]:
        """For logs, `models describe` and tests."""
        described: dict[str, Any] = {"runner": self.runner, "precision": self.precision}
        if self.file is not None:
            described["file"] = self.file
        if self.package is not None:
            described["cpu_capability"] = self.package.target.cpu_capability
        if self.cpu_kind is not None:
            described["cpu_kind"] = self.cpu_kind
        if self.solo_threads is not None:
            described["solo_threads"] = self.solo_threads
        if self.refusals:
            described["refused"] = [{"runner": refusal.runner, "reason": refusal.error.kind,
                                     "message": str(refusal.error)} for refusal in self.refusals]
        return described


@dataclass(frozen=True)
class Candidate:
    name: RunnerName
    file: str
    package: CompiledPackage | None = None


def candidates(runners: ArchiveRunners, machine: MachineTarget, kind: str) -> list[Candidate]:
    """The order of `kind`, less the runners this worker may not run (precision) and those the
    archive has no model for. An AOTInductor candidate is the richest package of its precision
    whose target fits (package_for); one that fits none stays, to be refused with the reason.
    int8 is allowed wherever the archive has an int8 model: the builder's gate let it in."""
    allowed_precisions = {"fp32", machine.precision, "int8"}
    found = []
    for name in order_for(kind, runners.order_table()):
        if name.precision not in allowed_precisions:
            continue
        if name.engine == "aoti":
            if any(package.target.precision == name.precision for package in runners.packages):
                found.append(Candidate(name, "", None))
            continue
        file = runners.engine_file(name.engine, name.precision)
        if file is not None:
            found.append(Candidate(name, file))
    return found


def resolved(candidate: Candidate, runners: ArchiveRunners, machine: MachineTarget) -> Candidate:
    """An AOTInductor candidate with its package: the richest of its precision whose target fits
    this machine (CompiledModelRefused with the misfit otherwise); others as they are."""
    if candidate.name.engine != "aoti":
        return candidate
    package = package_for(runners.packages, dataclasses.replace(machine, precision=candidate.name.precision))
    return Candidate(candidate.name, package.file, package)


def float_precision(runner_precision: str, worker_precision: str) -> str:
    """The precision a runner's float layers compute at: an int8 model's unquantized layers at
    the worker's precision (bf16 where it is native), others at their own."""
    return worker_precision if runner_precision == "int8" else runner_precision


def checked_precisions(runner_precision: str, worker_precision: str) -> tuple[str, ...]:
    """The precisions whose rounding a runner's answers may show: its own, and for int8 also its
    float layers' (a fp32 runner on a bf16 worker is held to fp32's bound)."""
    return tuple(dict.fromkeys((runner_precision, float_precision(runner_precision, worker_precision))))


def load_candidate(candidate: Candidate, model_dir: Path, machine: MachineTarget, threads: int,
                   solo_threads: int | None = None) -> Runner:
    """Load one resolved candidate (raises CompiledModelRefused("missing") without its file).
    An engine with threads of its own is loaded a second time at `solo_threads` when that is
    more than `threads`, for batches alone on the host (handlers.model.host_batches)."""
    path = model_dir / candidate.file
    if not path.is_file():
        raise CompiledModelRefused("missing", f"{candidate.file} is not in the archive")
    if candidate.package is not None:
        return ChunkedRunner(load_aoti_package(path, machine.device), candidate.package.target.max_batch_size)
    if solo_threads is not None and solo_threads > threads:
        return SoloThreadsRunner(load_candidate(candidate, model_dir, machine, threads),
                                 load_candidate(candidate, model_dir, machine, solo_threads),
                                 host_batches())
    if candidate.name.engine == "openvino":
        return OpenVinoRunner(path, float_precision(candidate.name.precision, machine.precision),
                              threads, openvino_cache_dir(model_dir))
    return OnnxRuntimeRunner(path, threads)


def unusable(runners: ArchiveRunners, machine: MachineTarget) -> RunnerChoice | None:
    """The eager choice where no compiled runner can serve (a GPU worker: the archive's models
    are for the CPU; an archive without any), else None."""
    if machine.device == "cpu" and runners:
        return None
    reason = () if not runners else (Refusal("all", CompiledModelRefused(
        "target", f"the archive's compiled models are for the CPU, this worker runs on "
                  f"{machine.device}")),)
    return RunnerChoice(EAGER, machine.precision, refusals=reason)


def first_that_serves(found: list[Candidate], runners: ArchiveRunners, machine: MachineTarget,
                      load_checked: Callable[[Candidate], Result]
                      ) -> tuple[Result | None, Candidate | None, tuple[Refusal, ...]]:
    """(what `load_checked` made of the first candidate it did not refuse, that candidate
    resolved, the refusals before it); (None, None, every refusal) when it refused them all."""
    refusals: list[Refusal] = []
    for candidate in found:
        try:
            loaded = resolved(candidate, runners, machine)
            return load_checked(loaded), loaded, tuple(refusals)
        except CompiledModelRefused as refusal:
            logger.warning("runner %s refused (%s): %s", candidate.name, refusal.kind, refusal)
            refusals.append(Refusal(str(candidate.name), refusal))
    if refusals:
        logger.warning("every compiled runner was refused: serving the eager model")
    return None, None, tuple(refusals)


def choose_runner(runners: ArchiveRunners, model_dir: Path, machine: MachineTarget, native_bf16: bool,
                  eager: EagerModel, timeout_s: float, threads: int,
                  solo_threads: int | None = None) -> tuple[Runner, RunnerChoice]:
    """(runner, choice): the first candidate that loads within `timeout_s` and passes the check on
    the archive's probe photos, else `eager.serve` (at the worker's precision) with every
    refusal. An archive with no compiled models: eager, nothing refused."""
    eager_choice = unusable(runners, machine)
    if eager_choice is not None:
        return eager.serve, eager_choice
    kind = cpu_kind(machine.cpu_capability, machine.cpu_features, native_bf16)
    try:
        probe = eager.model_input(load_probe_photos(model_dir))
    except CompiledModelRefused as refusal:
        return eager.serve, RunnerChoice(EAGER, machine.precision, None, kind, (Refusal("all", refusal),))
    # the eager network runs the probe once, when the first load is checked
    expected = functools.cache(lambda: reference_answers(eager.fp32, probe))

    def load_checked(candidate: Candidate) -> Runner:
        runner = call_with_deadline(
            functools.partial(load_candidate, candidate, model_dir, machine, threads, solo_threads),
            timeout_s)
        for each in loads_of(runner):
            check_answers(each, expected(), probe, *checked_precisions(candidate.name.precision,
                                                                       machine.precision))
        return runner

    runner, chosen, refusals = first_that_serves(candidates(runners, machine, kind), runners, machine,
                                                 load_checked)
    if runner is None or chosen is None:
        return eager.serve, RunnerChoice(EAGER, machine.precision, None, kind, refusals)
    solo = solo_threads if isinstance(runner, SoloThreadsRunner) else None
    return runner, RunnerChoice(str(chosen.name), chosen.name.precision, chosen.file, kind, refusals,
                                chosen.package, solo)


def choose_detector_runner(runners: ArchiveRunners, model_dir: Path, machine: MachineTarget,
                           native_bf16: bool, network: Any, timeout_s: float, threads: int,
                           solo_threads: int | None = None
                           ) -> tuple[BackboneHeadRunner | None, RunnerChoice]:
    """(the backbone + head's runner, choice) of an SSD-family detector: the first candidate of
    the archive's order that loads within `timeout_s` and whose head outputs for the probe
    photos pass handlers.model.ssd_engine.check_head_outputs (each load's, with `solo_threads`:
    handlers.model.host_batches); None (the eager network serves) when none does."""
    eager_choice = unusable(runners, machine)
    if eager_choice is not None:
        return None, eager_choice
    kind = cpu_kind(machine.cpu_capability, machine.cpu_features, native_bf16)
    try:
        probe = load_probe_photos(model_dir)
    except CompiledModelRefused as refusal:
        return None, RunnerChoice(EAGER, machine.precision, None, kind, (Refusal("all", refusal),))
    # the eager network runs the probe once, when the first load is checked
    reference = functools.cache(lambda: probe_head_reference(network, probe))

    def load_checked(candidate: Candidate) -> tuple[BackboneHeadRunner, bool]:
        engine = call_with_deadline(
            functools.partial(load_candidate, candidate, model_dir, machine, threads, solo_threads),
            timeout_s)
        precisions = checked_precisions(candidate.name.precision, machine.precision)

        def disagreement(outputs: BackboneHeadRunner) -> str | None:
            return check_head_outputs(outputs, network, reference(), *precisions)

        for each in loads_of(engine):
            refuse_unless_alike(functools.partial(disagreement, each.outputs),  # type: ignore[attr-defined]
                                "head outputs differ from the fp32 eager network's")
        outputs: BackboneHeadRunner = engine.outputs  # type: ignore[attr-defined]
        return outputs, isinstance(engine, SoloThreadsRunner)

    loaded, chosen, refusals = first_that_serves(candidates(runners, machine, kind), runners, machine,
                                                 load_checked)
    if loaded is None or chosen is None:
        return None, RunnerChoice(EAGER, machine.precision, None, kind, refusals)
    outputs, solo = loaded
    return outputs, RunnerChoice(str(chosen.name), chosen.name.precision, chosen.file, kind, refusals,
                                 solo_threads=solo_threads if solo else None)


def refuse_unless_alike(check: Callable[[], str | None], differs: str) -> None:
    """CompiledModelRefused("wrong_output") when `check` (an engine's answers to the probe
    photos against the reference's: why they differ, or None) fails to run or finds a
    difference; `differs` says what differed ("outputs differ from the export's")."""
    try:
        reason = check()
    except Exception as error:  # noqa: BLE001 - an engine that cannot run the probe is refused
        raise CompiledModelRefused("wrong_output", f"running the probe photos failed: "
                                   f"{type(error).__name__}: {error}") from None
    if reason is not None:
        raise CompiledModelRefused("wrong_output", f"the probe photos' {differs}: {reason}")


def choose_ultralytics_runner(runners: ArchiveRunners, model_dir: Path, machine: MachineTarget,
                              native_bf16: bool, export: Any, timeout_s: float, threads: int
                              ) -> tuple[Runner | None, RunnerChoice]:
    """(runner, choice) of an Ultralytics detection export: the first candidate of the archive's
    order that loads within `timeout_s` and whose raw outputs on the probe photos pass
    handlers.model.ultralytics_engine.check_outputs against `export`; None (the export serves)
    when none does."""
    eager_choice = unusable(runners, machine)
    if eager_choice is not None:
        return None, eager_choice
    kind = cpu_kind(machine.cpu_capability, machine.cpu_features, native_bf16)
    try:
        probe = load_probe_photos(model_dir)
    except CompiledModelRefused as refusal:
        return None, RunnerChoice(EAGER, machine.precision, None, kind, (Refusal("all", refusal),))
    # the export runs the probe once, when the first candidate is checked
    reference = functools.cache(lambda: probe_outputs(export, probe))

    def load_checked(candidate: Candidate) -> Runner:
        engine = call_with_deadline(
            functools.partial(load_candidate, candidate, model_dir, machine, threads), timeout_s)
        refuse_unless_alike(lambda: check_outputs(engine, reference()), "outputs differ from the export's")
        return engine

    engine, chosen, refusals = first_that_serves(candidates(runners, machine, kind), runners, machine,
                                                 load_checked)
    if engine is None or chosen is None:
        return None, RunnerChoice(EAGER, machine.precision, None, kind, refusals)
    return engine, RunnerChoice(str(chosen.name), chosen.name.precision, chosen.file, kind, refusals)
