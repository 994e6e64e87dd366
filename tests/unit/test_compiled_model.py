"""Ahead-of-time compiled packages: the target check, bounded loading, the check against the
eager model, and a worker that serves eagerly (and correctly) whenever a package is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

from handlers import compiled_model
from handlers.compiled_model import (
    ChunkedRunner,
    CompiledModelRefused,
    CompiledPackage,
    CompileTarget,
    MachineTarget,
    call_with_deadline,
    check_against_eager,
    package_for,
    target_mismatch,
)
from handlers.image_classifier import ImageClassifierHandler
from tests.answers import assert_same_answer
from tests.archives import archive_context, load_classifier_dir
from tests.images import photo_bytes

TARGET = CompileTarget("2.14.1+cu130", "cpu", "AVX2", "fp32", 8, (3, 224, 224), True)
MACHINE = MachineTarget("2.14.1+cu130", "cpu", "AVX2", "fp32")
PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg"]


@pytest.mark.parametrize(("machine", "reason"), [
    (MACHINE, None),
    (MachineTarget("2.14.1+cu130", "cpu", "AVX512", "fp32"), None),  # a richer CPU runs AVX2 code
    (MachineTarget("2.14.1+cu130", "cpu", "DEFAULT", "fp32"), "CPU capability AVX2"),
    (MachineTarget("2.15.0", "cpu", "AVX2", "fp32"), "torch 2.14.1+cu130"),
    (MachineTarget("2.14.1+cu130", "cuda", "AVX2", "fp32"), "built for cpu"),
    (MachineTarget("2.14.1+cu130", "cpu", "AVX2", "bf16"), "built for fp32"),
])
def test_a_package_runs_only_on_a_machine_that_fits_its_target(machine, reason):
    mismatch = target_mismatch(TARGET, machine)
    if reason is None:
        assert mismatch is None
    else:
        assert mismatch is not None and reason in mismatch


def test_an_unknown_recorded_capability_is_refused():
    unknown = CompileTarget("2.14.1+cu130", "cpu", "AVX1024", "fp32", 8, (3, 8, 8), False)
    assert target_mismatch(unknown, MACHINE) is not None


def test_the_package_of_the_worker_precision_is_chosen():
    bf16 = CompiledPackage("compiled/model-bf16.pt2", dataclasses.replace(TARGET, precision="bf16"))
    fp32 = CompiledPackage("compiled/model-fp32.pt2", TARGET)
    assert package_for([bf16, fp32], MACHINE) == fp32
    assert package_for([fp32, bf16], dataclasses.replace(MACHINE, precision="bf16")) == bf16
    with pytest.raises(CompiledModelRefused, match="no compiled package for fp32") as refused:
        package_for([bf16], MACHINE)
    assert refused.value.kind == "target"


def test_the_target_record_round_trips_through_the_archive_yaml():
    assert CompileTarget.from_dict(yaml.safe_load(yaml.safe_dump(TARGET.to_dict()))) == TARGET


def test_batches_over_the_compiled_bound_run_in_chunks():
    seen: list[int] = []

    def compiled(batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.shape[0])
        return batch * 2

    batch = torch.arange(19.0).reshape(19, 1)
    assert torch.equal(ChunkedRunner(compiled, 8)(batch), batch * 2)
    assert seen == [8, 8, 3]


def test_a_slow_or_failing_load_is_refused_within_its_deadline():
    def slow() -> compiled_model.Runner:
        time.sleep(5)
        return torch.nn.Identity()

    started = time.monotonic()
    with pytest.raises(CompiledModelRefused, match=r"longer than 0\.2 s") as refused:
        call_with_deadline(slow, 0.2)
    assert refused.value.kind == "load_timeout" and time.monotonic() - started < 2

    def failing() -> compiled_model.Runner:
        raise RuntimeError("bad package")

    with pytest.raises(CompiledModelRefused, match="bad package") as refused:
        call_with_deadline(failing, 5)
    assert refused.value.kind == "load_failed"


def test_a_package_whose_output_differs_from_the_eager_model_is_refused():
    probe = torch.randn(2, 10)
    check_against_eager(lambda x: x * 2 + 1e-6, lambda x: x * 2, probe, "fp32")
    with pytest.raises(CompiledModelRefused, match="differs") as refused:
        check_against_eager(lambda x: x * 2.5, lambda x: x * 2, probe, "fp32")
    assert refused.value.kind == "wrong_output"
    with pytest.raises(CompiledModelRefused, match="differs"):
        check_against_eager(lambda x: x * float("nan"), lambda x: x * 2, probe, "fp32")


# --- a worker whose package is refused serves eagerly, and correctly --------------------------------
def model_dir_copy(classifier: ImageClassifierHandler, target: Path, **target_changes: object) -> Path:
    """The default classifier's extracted archive, its packages' recorded target changed."""
    shutil.copytree(classifier.model_dir, target)
    config_path = target / "model-config.yaml"
    config = yaml.safe_load(config_path.read_text())
    for package in config["handler"]["compiled_packages"]:
        package["target"].update(target_changes)
    config["handler"]["compile"] = {"cpu_target": "avx2", "load_timeout_s": 1}
    config_path.write_text(yaml.safe_dump(config))
    return target


def answers(handler: ImageClassifierHandler) -> list[list[dict]]:
    context = archive_context(handler.model_dir, request_headers=[{} for _ in PHOTOS])
    bodies = handler.handle([{"body": bytearray(photo_bytes(name))} for name in PHOTOS], context)
    assert all(context.status(index) == 200 for index in range(len(PHOTOS)))
    return [json.loads(body) for body in bodies]


@pytest.fixture(scope="module")
def reference(classifier: ImageClassifierHandler) -> list[list[dict]]:
    assert classifier.runner == "aot"
    return answers(classifier)


def assert_serves_eagerly(handler: ImageClassifierHandler, kind: str, reference: list[list[dict]]) -> None:
    assert handler.runner == "eager" and handler.initialized
    assert handler.compiled_refusal is not None and handler.compiled_refusal.kind == kind
    for got, expected in zip(answers(handler), reference, strict=True):
        assert_same_answer(got, expected, handler.precision)


def test_a_package_built_with_another_torch_is_refused(classifier, reference, tmp_path):
    handler = load_classifier_dir(model_dir_copy(classifier, tmp_path / "m", torch_version="2.0.0"))
    assert_serves_eagerly(handler, "target", reference)
    assert "torch 2.0.0" in str(handler.compiled_refusal)


def test_a_cpu_without_the_package_instruction_set_serves_eagerly(classifier, reference, tmp_path,
                                                                  monkeypatch):
    # Only the package check sees it: torchvision's uint8 resize picks kernels by the capability too.
    monkeypatch.setattr(compiled_model, "cpu_capability", lambda: "DEFAULT")
    handler = load_classifier_dir(model_dir_copy(classifier, tmp_path / "m"))
    assert_serves_eagerly(handler, "target", reference)


def test_a_corrupt_package_is_refused(classifier, reference, tmp_path):
    model_dir = model_dir_copy(classifier, tmp_path / "m")
    for package in (model_dir / "compiled").glob("*.pt2"):
        package.write_bytes(package.read_bytes()[:4096])
    assert_serves_eagerly(load_classifier_dir(model_dir), "load_failed", reference)


def test_a_package_that_loads_too_slowly_is_abandoned(classifier, reference, tmp_path, monkeypatch):
    def slow_load(path: Path) -> compiled_model.Runner:
        time.sleep(3)
        raise AssertionError("abandoned load went on")

    monkeypatch.setattr(compiled_model, "load_aoti_package", slow_load)
    started = time.monotonic()
    handler = load_classifier_dir(model_dir_copy(classifier, tmp_path / "m"))
    assert time.monotonic() - started < 3
    assert_serves_eagerly(handler, "load_timeout", reference)


def test_a_package_with_wrong_answers_is_refused(classifier, reference, tmp_path, monkeypatch):
    monkeypatch.setattr(compiled_model, "load_aoti_package",
                        lambda path: (lambda batch: torch.zeros(batch.shape[0], 1000)))
    handler = load_classifier_dir(model_dir_copy(classifier, tmp_path / "m"))
    assert_serves_eagerly(handler, "wrong_output", reference)
