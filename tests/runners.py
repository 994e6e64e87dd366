"""What the archive's runner order says a CPU worker here serves first, for the tests that
check it does (handlers/model/runner_selection.py), and how they watch its checks."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from handlers.model.compiled_model import MachineTarget
from handlers.model.engine_runners import OnnxRuntimeRunner, OpenVinoRunner
from handlers.model.model_loading import cpu_has_native_bf16, effective_precision
from handlers.model.runner_order import cpu_kind
from handlers.model.runner_selection import EAGER, candidates
from handlers.model.settings import parse_classifier_settings, parse_detector_settings


def first_runner_here(handler_section: Mapping[str, Any], role: str = "classifier") -> str:
    """The first runner of a network's order (its archive YAML's `handler:` section; `role`
    "detector" for a detector's) that this CPU may run and the archive has a model for."""
    parse = parse_detector_settings if role == "detector" else parse_classifier_settings
    settings = parse(handler_section)
    native_bf16 = cpu_has_native_bf16()
    cpu = torch.device("cpu")
    machine = MachineTarget.here(cpu, effective_precision(settings.precision, cpu, native_bf16))
    kind = cpu_kind(machine.cpu_capability, machine.cpu_features, native_bf16)
    found = candidates(settings.archive_runners, machine, kind)
    return str(found[0].name) if found else EAGER          # an archive without compiled models


def network_sections(mar: Path) -> dict[str, Mapping[str, Any]]:
    """Network role -> `handler:` section, for a single-network archive ("classifier" or
    "detector") or each stage of a pipeline archive."""
    with zipfile.ZipFile(mar) as archive:
        handler = yaml.safe_load(archive.read("model-config.yaml"))["handler"]
    if "stages" not in handler:
        return {"detector" if "detection" in handler else "classifier": handler}
    return {role: stage["handler"] for role, stage in handler["stages"].items()}


def engine_threads(runner: object) -> int:
    """The threads an OpenVINO or ONNX Runtime runner computes on, as its engine reports them."""
    if isinstance(runner, OpenVinoRunner):
        return int(runner.compiled.get_property("INFERENCE_NUM_THREADS"))
    assert isinstance(runner, OnnxRuntimeRunner), runner
    return int(runner.session.get_session_options().intra_op_num_threads)


def threads_given(asked: int, runner: object) -> int:
    """The threads `runner`'s engine computes on when asked for `asked`: OpenVINO takes no more
    than the cores this process may run on (one under `taskset -c 0`), ONNX Runtime as many as
    it is asked for."""
    if isinstance(runner, OpenVinoRunner):
        return min(asked, len(os.sched_getaffinity(0)))
    return asked


def spins_on_after_a_run(runner: object) -> bool:
    """Whether an ONNX Runtime runner's threads spin on after a run ends (the engine's default)."""
    assert isinstance(runner, OnnxRuntimeRunner), runner
    try:
        entry = runner.session.get_session_options().get_session_config_entry(
            "session.force_spinning_stop")
    except RuntimeError:    # never set: the default
        return True
    return entry != "1"


def noting_calls(module: Any, names: tuple[str, ...], calls: list[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`module`'s functions `names` replaced, for the test, by ones that note their name in
    `calls`, then call them."""
    for name in names:
        monkeypatch.setattr(module, name, noting(name, getattr(module, name), calls))


def noting(name: str, function: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    """`function` (a runner, a check), noting `name` in `calls` at every call."""
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return function(*args, **kwargs)
    return call
