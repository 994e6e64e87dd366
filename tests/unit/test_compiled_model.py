"""Ahead-of-time compiled packages: the target check (CPU capability and the x86-64 level's
features), bounded loading, the check of a package's answers against the eager model on the
archive's probe photos, and a worker that serves eagerly (and correctly) whenever a package is
refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import yaml

from handlers.image_classifier import ImageClassifierHandler
from handlers.model import compiled_model, runner_selection
from handlers.model.compiled_model import (
    ChunkedRunner,
    CompiledModelRefused,
    CompiledPackage,
    CompileTarget,
    MachineTarget,
    call_with_deadline,
    check_answers,
    cpu_features,
    missing_cpu_features,
    package_for,
    reference_answers,
    target_mismatch,
)
from tests.answers import assert_same_answer
from tests.archives import archive_context, load_classifier_dir
from tests.images import photo_bytes
from tests.recording_metrics import RecordingMetrics

X86_64_V3 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1",
                       "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
TARGET = CompileTarget("2.14.1+cu130", "cpu", "AVX2", "fp32", 8, (3, 224, 224), True)
MACHINE = MachineTarget("2.14.1+cu130", "cpu", "AVX2", "fp32", X86_64_V3)
PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg"]


@pytest.mark.parametrize(("machine", "reason"), [
    (MACHINE, None),
    (dataclasses.replace(MACHINE, cpu_capability="AVX512", cpu_features=X86_64_V4), None),
    (dataclasses.replace(MACHINE, cpu_capability="DEFAULT"), "CPU capability AVX2"),
    (dataclasses.replace(MACHINE, torch_version="2.15.0"), "torch 2.14.1+cu130"),
    (dataclasses.replace(MACHINE, device="cuda"), "built for cpu"),
    (dataclasses.replace(MACHINE, precision="bf16"), "built for fp32"),
])
def test_a_package_runs_only_on_a_machine_that_fits_its_target(machine, reason):
    mismatch = target_mismatch(TARGET, machine)
    if reason is None:
        assert mismatch is None
    else:
        assert mismatch is not None and mismatch.kind == "target" and reason in str(mismatch)


@pytest.mark.parametrize("hidden", ["bmi2", "fma", "movbe", "f16c", "abm", "avx2"])
def test_an_avx2_cpu_that_hides_an_x86_64_v3_feature_cannot_run_avx2_packages(hidden):
    # ATen still says AVX2 (it asks for AVX2 and FMA only), as on a VM that masks BMI2 or MOVBE.
    machine = dataclasses.replace(MACHINE, cpu_features=X86_64_V3 - {hidden})
    refusal = target_mismatch(TARGET, machine)
    assert refusal is not None and refusal.kind == "cpu_features"
    assert hidden in str(refusal) and "x86-64-v3" in str(refusal)


def test_avx512_packages_need_every_x86_64_v4_feature():
    avx512 = dataclasses.replace(TARGET, cpu_capability="AVX512")
    assert missing_cpu_features("AVX512", X86_64_V4) is None
    assert "avx512vl" in (missing_cpu_features("AVX512", X86_64_V4 - {"avx512vl"}) or "")
    refusal = target_mismatch(avx512, dataclasses.replace(MACHINE, cpu_capability="AVX512",
                                                          cpu_features=X86_64_V3))
    assert refusal is not None and refusal.kind == "cpu_features"


def test_unknown_cpu_features_refuse_a_cpu_package():
    assert "cannot be read" in (missing_cpu_features("AVX2", None) or "")


def test_cpu_features_are_read_from_the_first_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 bmi2\nbugs\t: x\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_features(cpuinfo) == {"fpu", "avx2", "bmi2"}
    assert cpu_features(tmp_path / "missing") is None
    assert cpu_features() is not None  # this Linux machine's own


def test_the_richest_package_this_cpu_runs_is_chosen():
    avx2 = CompiledPackage("compiled/model-fp32-avx2.pt2", TARGET)
    avx512 = CompiledPackage("compiled/model-fp32-avx512.pt2",
                             dataclasses.replace(TARGET, cpu_capability="AVX512"))
    rich = dataclasses.replace(MACHINE, cpu_capability="AVX512", cpu_features=X86_64_V4)
    assert package_for([avx2, avx512], rich) == avx512
    assert package_for([avx2, avx512], MACHINE) == avx2
    with pytest.raises(CompiledModelRefused) as refused:
        package_for([avx2, avx512], dataclasses.replace(MACHINE, cpu_features=X86_64_V3 - {"bmi2"}))
    assert refused.value.kind == "cpu_features"


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
    release, finished = threading.Event(), threading.Event()

    def slow() -> compiled_model.Runner:
        release.wait(60)
        finished.set()
        return torch.nn.Identity()

    with pytest.raises(CompiledModelRefused, match=r"longer than 0\.2 s") as refused:
        call_with_deadline(slow, 0.2)
    assert refused.value.kind == "load_timeout"
    assert not finished.is_set()     # refused while the load was still running
    release.set()

    def failing() -> compiled_model.Runner:
        raise RuntimeError("bad package")

    with pytest.raises(CompiledModelRefused, match="bad package") as refused:
        call_with_deadline(failing, 5)
    assert refused.value.kind == "load_failed"


def test_a_package_whose_answers_differ_from_the_eager_model_is_refused():
    probe = torch.randn(3, 10) * 4
    expected = reference_answers(lambda x: x * 2, probe)
    check_answers(lambda x: x * 2 + 1e-6, expected, probe, "fp32")
    check_answers(lambda x: x * 2.02, expected, probe, "bf16")  # within bf16's rounding
    for wrong in (lambda x: x * 2.5, lambda x: x.flip(1) * 2, lambda x: x * float("nan")):
        with pytest.raises(CompiledModelRefused, match="answered differently") as refused:
            check_answers(wrong, expected, probe, "fp32")
        assert refused.value.kind == "wrong_output"


def test_a_package_that_cannot_run_the_probe_is_refused():
    def fails(batch: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("input shape mismatch")

    probe = torch.randn(2, 10)
    with pytest.raises(CompiledModelRefused, match="input shape mismatch") as refused:
        check_answers(fails, reference_answers(lambda x: x, probe), probe, "fp32")
    assert refused.value.kind == "wrong_output"
    with pytest.raises(CompiledModelRefused, match="output shape"):
        check_answers(lambda x: x[:, :5], reference_answers(lambda x: x, probe), probe, "fp32")


# --- a worker whose package is refused serves eagerly, and correctly --------------------------------
def model_dir_copy(classifier: ImageClassifierHandler, target: Path, **target_changes: object) -> Path:
    """The default classifier's extracted archive, its packages' recorded target changed."""
    shutil.copytree(classifier.model_dir, target)
    config_path = target / "model-config.yaml"
    config = yaml.safe_load(config_path.read_text())
    for package in config["handler"]["compiled_packages"]:
        package["target"].update(target_changes)
    config["handler"]["compile"] = {"cpu_target": "avx2", "load_timeout_s": 1}
    config["handler"]["runner_order"] = AOTI_ONLY     # what these tests refuse: the packages
    config_path.write_text(yaml.safe_dump(config))
    return target


def answers(handler: ImageClassifierHandler) -> list[list[dict]]:
    context = archive_context(handler.model_dir, request_headers=[{} for _ in PHOTOS])
    bodies = handler.handle([{"body": bytearray(photo_bytes(name))} for name in PHOTOS], context)
    assert all(context.status(index) == 200 for index in range(len(PHOTOS)))
    return [json.loads(body) for body in bodies]


AOTI_ONLY = {"avx512_bf16": ["aoti-bf16"], "avx2": ["aoti-fp32"]}   # the worker precision's package


@pytest.fixture(scope="module")
def reference(classifier: ImageClassifierHandler) -> list[list[dict]]:
    assert classifier.runner != "eager"
    return answers(classifier)


def assert_serves_eagerly(handler: ImageClassifierHandler, kind: str, reference: list[list[dict]]) -> None:
    """Every package this worker may run was tried, each refused for `kind`, and the eager
    network answers as the compiled one did."""
    assert handler.runner == "eager" and handler.initialized
    choice = handler.runners["classifier"]
    tried = [f"aoti-{handler.precision}"]
    assert choice.runner == "eager" and [refusal.runner for refusal in choice.refusals] == tried
    assert {refusal.error.kind for refusal in choice.refusals} == {kind}
    described = handler.describe()["runners"]["classifier"]
    assert [refusal["reason"] for refusal in described["refused"]] == [kind]
    for got, expected in zip(answers(handler), reference, strict=True):
        assert_same_answer(got, expected, handler.precision)


def first_refusal(handler: ImageClassifierHandler) -> CompiledModelRefused:
    return handler.runners["classifier"].refusals[0].error


def test_a_package_built_with_another_torch_is_refused(classifier, reference, tmp_path):
    handler = load_classifier_dir(model_dir_copy(classifier, tmp_path / "m", torch_version="2.0.0"))
    assert_serves_eagerly(handler, "target", reference)
    assert "torch 2.0.0" in str(first_refusal(handler))


def test_a_cpu_that_hides_a_feature_of_the_package_serves_eagerly_and_says_so(
        classifier, reference, tmp_path, monkeypatch, caplog):
    features = cpu_features()
    assert features is not None
    monkeypatch.setattr(compiled_model, "cpu_features", lambda: features - {"movbe"})
    metrics = RecordingMetrics()
    with caplog.at_level("WARNING", logger="handlers.model.runner_selection"):
        handler = load_classifier_dir(model_dir_copy(classifier, tmp_path / "m"), metrics=metrics)
    assert_serves_eagerly(handler, "cpu_features", reference)
    assert any(f"aoti-{handler.precision} refused (cpu_features)" in r.getMessage()
               and "movbe" in r.getMessage()
               for r in caplog.records)
    refused = [("HandlerCompiledModelRefusals", 1, {"Reason": "cpu_features", "Runner": refusal.runner})
               for refusal in handler.runners["classifier"].refusals]
    assert metrics.counters_of("HandlerRunnerSelected", "HandlerCompiledModelRefusals") == [
        ("HandlerRunnerSelected", 1, {"Network": "classifier", "Runner": "eager"}), *refused]


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
    release, finished = threading.Event(), threading.Event()

    def slow_load(path: Path, device: str = "cpu") -> compiled_model.Runner:
        release.wait(60)
        finished.set()
        raise AssertionError("abandoned load went on")

    monkeypatch.setattr(runner_selection, "load_aoti_package", slow_load)
    handler = load_classifier_dir(model_dir_copy(classifier, tmp_path / "m"))
    assert not finished.is_set()     # the worker went on while the load was still running
    release.set()
    assert_serves_eagerly(handler, "load_timeout", reference)


def test_a_package_with_wrong_answers_is_refused(classifier, reference, tmp_path, monkeypatch):
    monkeypatch.setattr(runner_selection, "load_aoti_package",
                        lambda path, device="cpu": (lambda batch: torch.zeros(batch.shape[0], 1000)))
    handler = load_classifier_dir(model_dir_copy(classifier, tmp_path / "m"))
    assert_serves_eagerly(handler, "wrong_output", reference)


# --- a package that is not the archive's model is refused ------------------------------------------
def test_a_package_that_does_not_hold_the_archive_weights_is_refused(classifier, tmp_path):
    # The archive's weights altered as a later checkpoint would differ (its classifier head
    # perturbed by 30% of its spread), its packages kept: they no longer compute this model.
    model_dir = model_dir_copy(classifier, tmp_path / "m")
    weights_path = model_dir / archive_context(model_dir).manifest["model"]["serializedFile"]
    state = torch.load(weights_path, weights_only=True)
    head = state["classifier.weight"]
    generator = torch.Generator().manual_seed(0)
    state["classifier.weight"] = head + 0.3 * head.std() * torch.randn(head.shape, generator=generator)
    torch.save(state, weights_path)
    handler = load_classifier_dir(model_dir)
    refusal = first_refusal(handler)
    assert handler.runner == "eager" and refusal.kind == "wrong_output"
    assert "probe photo" in str(refusal)


def test_a_package_built_for_another_model_is_refused(classifier, foreign_packages, tmp_path):
    # Another network's packages, with Lite0's input, in the Lite0 archive.
    model_dir = model_dir_copy(classifier, tmp_path / "m")
    packages = list((model_dir / "compiled").glob("*.pt2"))
    assert packages
    for package in packages:
        shutil.copy(foreign_packages / package.name, package)
    handler = load_classifier_dir(model_dir)
    refusal = first_refusal(handler)
    assert handler.runner == "eager" and refusal.kind == "wrong_output"
    assert answers(handler)[1][0]["label"] == "espresso"
