"""Which runner serves a classifier: candidates from the archive's order for the CPU's kind (pure),
then, on the real Lite0 archive, every runner serving alone answers as the eager network does, a
runner that fails its check is refused and the next one serves, and the choice is described,
logged and counted."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from handlers.image_classifier import ImageClassifierHandler
from handlers.model import model_loading, runner_selection
from handlers.model.compiled_model import CompiledPackage, CompileTarget, MachineTarget
from handlers.model.engine_runners import OpenVinoRunner
from handlers.model.host_batches import LOCK_DIR_VARIABLE, LOCK_FILE_NAME, SoloThreadsRunner, host_batches
from handlers.model.runner_order import parse_runner_order
from handlers.model.runner_selection import (
    ArchiveRunners,
    EngineModel,
    candidates,
    checked_precisions,
    float_precision,
)
from tests.answers import assert_same_answer
from tests.archives import load_classifier_dir, photo_answers
from tests.recording_metrics import RecordingMetrics
from tests.runners import engine_threads, noting, noting_calls, spins_on_after_a_run, threads_given
from tests.unit.test_host_batches import other_worker_in_a_batch

TARGET = CompileTarget("2.14.1", "cpu", "AVX2", "fp32", 8, (3, 224, 224), True)
FP32_PACKAGE = CompiledPackage("compiled/model-fp32.pt2", TARGET)
BF16_PACKAGE = CompiledPackage("compiled/model-bf16.pt2", dataclasses.replace(TARGET, precision="bf16"))
OPENVINO = EngineModel("openvino", "compiled/model-openvino.xml")
ONNX = EngineModel("onnxruntime", "compiled/model.onnx")
ORDER = parse_runner_order({
    "avx512_bf16": ["openvino-bf16", "aoti-bf16", "onnxruntime-fp32", "openvino-fp32", "aoti-fp32"],
    "avx2": ["onnxruntime-fp32", "openvino-fp32", "aoti-fp32"]})
BF16_MACHINE = MachineTarget("2.14.1", "cpu", "AVX512", "bf16", frozenset({"avx512_bf16"}))
PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]


def names(runners: ArchiveRunners, machine: MachineTarget, kind: str) -> list[str]:
    return [str(candidate.name) for candidate in candidates(runners, machine, kind)]


def test_candidates_follow_the_order_of_the_cpu_kind():
    runners = ArchiveRunners((FP32_PACKAGE, BF16_PACKAGE), (OPENVINO, ONNX), ORDER)
    assert names(runners, BF16_MACHINE, "avx512_bf16") == [
        "openvino-bf16", "aoti-bf16", "onnxruntime-fp32", "openvino-fp32", "aoti-fp32"]
    assert names(runners, BF16_MACHINE, "amx") == names(runners, BF16_MACHINE, "avx512_bf16")


def test_bf16_runners_are_not_candidates_where_the_worker_runs_fp32():
    # A CPU with native bf16 serving a model that asks for fp32, or the same order on a lesser CPU.
    runners = ArchiveRunners((FP32_PACKAGE, BF16_PACKAGE), (OPENVINO, ONNX), ORDER)
    fp32_machine = dataclasses.replace(BF16_MACHINE, precision="fp32")
    assert names(runners, fp32_machine, "avx512_bf16") == ["onnxruntime-fp32", "openvino-fp32", "aoti-fp32"]


def test_runners_the_archive_has_no_model_for_are_skipped():
    only_packages = ArchiveRunners((FP32_PACKAGE,), (), ORDER)
    assert names(only_packages, BF16_MACHINE, "avx512_bf16") == ["aoti-fp32"]
    only_onnx = ArchiveRunners((), (ONNX,), ORDER)
    assert names(only_onnx, BF16_MACHINE, "avx2") == ["onnxruntime-fp32"]


def test_an_int8_model_is_a_candidate_on_every_cpu_and_only_where_the_archive_has_one():
    # The builder's gate let it in; its float layers run at the worker's precision.
    int8 = EngineModel("openvino", "compiled/model-openvino-int8.xml", "int8")
    order = parse_runner_order({"avx512_bf16": ["openvino-int8", "openvino-bf16"],
                                "avx2": ["openvino-int8", "onnxruntime-fp32"]})
    with_int8 = ArchiveRunners((), (OPENVINO, ONNX, int8), order)
    fp32_machine = dataclasses.replace(BF16_MACHINE, precision="fp32")
    assert names(with_int8, BF16_MACHINE, "avx512_bf16") == ["openvino-int8", "openvino-bf16"]
    assert names(with_int8, fp32_machine, "avx2") == ["openvino-int8", "onnxruntime-fp32"]
    assert candidates(with_int8, fp32_machine, "avx2")[0].file == int8.file
    without = ArchiveRunners((), (OPENVINO, ONNX), order)
    assert names(without, fp32_machine, "avx2") == ["onnxruntime-fp32"]
    assert float_precision("int8", "bf16") == "bf16" and float_precision("int8", "fp32") == "fp32"
    assert float_precision("fp32", "bf16") == "fp32"
    # The check's bound: a fp32 runner on a bf16 worker is held to fp32's, int8 to both its own.
    assert checked_precisions("fp32", "bf16") == ("fp32",)
    assert checked_precisions("bf16", "bf16") == ("bf16",)
    assert checked_precisions("int8", "bf16") == ("int8", "bf16")
    assert checked_precisions("int8", "fp32") == ("int8", "fp32")


def test_an_archive_without_an_order_uses_the_default_one():
    runners = ArchiveRunners((FP32_PACKAGE,), (OPENVINO, ONNX), None)
    assert names(runners, dataclasses.replace(BF16_MACHINE, precision="fp32"), "avx2") == [
        "onnxruntime-fp32", "openvino-fp32", "aoti-fp32"]


# --- on the real archive ---------------------------------------------------------------------------
def model_dir_with_order(classifier: ImageClassifierHandler, target: Path, order: list[str]) -> Path:
    """The default classifier's extracted archive, its order for every CPU kind set to `order`."""
    shutil.copytree(classifier.model_dir, target, ignore=shutil.ignore_patterns("openvino-cache"))
    config_path = target / "model-config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["handler"]["runner_order"] = {"avx512_bf16": order, "avx2": order}
    config_path.write_text(yaml.safe_dump(config))
    return target


@pytest.fixture(scope="module")
def eager_answers(classifier, tmp_path_factory) -> list[list[dict]]:
    """The eager fp32 network's answers (an order with no runner: the worker serves eagerly)."""
    model_dir = model_dir_with_order(classifier, tmp_path_factory.mktemp("eager") / "m", [])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_loading, "cpu_has_native_bf16", lambda: False)
        eager = load_classifier_dir(model_dir)
    assert eager.runner == "eager" and eager.precision == "fp32"
    return photo_answers(eager, PHOTOS)


@pytest.mark.parametrize("runner", ["aoti-fp32", "aoti-bf16", "openvino-fp32", "openvino-bf16",
                                    "onnxruntime-fp32"])
def test_every_runner_of_the_archive_serves_alone_and_answers_as_eager_at_every_batch_size(
        classifier, eager_answers, tmp_path, runner):
    handler = load_classifier_dir(model_dir_with_order(classifier, tmp_path / "m", [runner]))
    precision = runner.split("-")[1]
    if precision == "bf16" and handler.precision != "bf16":
        # No native bf16 here: a bf16 runner is not a candidate, nothing is refused.
        assert handler.runner == "eager" and handler.runners["classifier"].refusals == ()
        return
    choice = handler.runners["classifier"]
    assert (choice.runner, choice.refusals) == (runner, ())
    for count in (len(PHOTOS), 1, 3):
        for got, expected in zip(photo_answers(handler, PHOTOS[:count]), eager_answers, strict=False):
            assert_same_answer(got, expected, precision)


def test_a_runner_that_fails_its_check_is_refused_and_the_next_one_serves(
        classifier, eager_answers, tmp_path, caplog):
    # The OpenVINO model's weights file cut short: it cannot be compiled, ONNX Runtime serves.
    model_dir = model_dir_with_order(classifier, tmp_path / "m", ["openvino-fp32", "onnxruntime-fp32"])
    weights = model_dir / "compiled" / "model-openvino.bin"
    weights.write_bytes(weights.read_bytes()[:4096])
    metrics = RecordingMetrics()
    with caplog.at_level("WARNING", logger="handlers.model.runner_selection"):
        handler = load_classifier_dir(model_dir, metrics=metrics)
    choice = handler.runners["classifier"]
    assert choice.runner == "onnxruntime-fp32" and choice.file == "compiled/model.onnx"
    assert [(refusal.runner, refusal.error.kind) for refusal in choice.refusals] == [
        ("openvino-fp32", "load_failed")]
    assert any("openvino-fp32 refused (load_failed)" in record.getMessage() for record in caplog.records)
    described = handler.describe()["runners"]["classifier"]
    assert described["runner"] == "onnxruntime-fp32"
    assert [refusal["runner"] for refusal in described["refused"]] == ["openvino-fp32"]
    assert metrics.counters_of("HandlerRunnerSelected", "HandlerCompiledModelRefusals") == [
        ("HandlerRunnerSelected", 1, {"Network": "classifier", "Runner": "onnxruntime-fp32"}),
        ("HandlerCompiledModelRefusals", 1, {"Reason": "load_failed", "Runner": "openvino-fp32"})]
    for got, expected in zip(photo_answers(handler, PHOTOS), eager_answers, strict=True):
        assert_same_answer(got, expected, "fp32")


def test_a_runner_of_another_model_is_refused_for_its_answers(classifier, foreign_packages, tmp_path):
    # Another network's ONNX model, with Lite0's input, in the Lite0 archive: it answers the
    # probe photos wrongly, so it is refused and the eager network serves.
    model_dir = model_dir_with_order(classifier, tmp_path / "m", ["onnxruntime-fp32"])
    (model_dir / "compiled" / "model.onnx").write_bytes((foreign_packages / "model.onnx").read_bytes())
    handler = load_classifier_dir(model_dir)
    choice = handler.runners["classifier"]
    assert choice.runner == "eager"
    assert [(refusal.runner, refusal.error.kind) for refusal in choice.refusals] == [
        ("onnxruntime-fp32", "wrong_output")]


@pytest.mark.parametrize(("order", "torch_threads_after"), [(["openvino-fp32"], 1), (["aoti-fp32"], 2)])
def test_torch_keeps_one_thread_where_another_engine_computes_on_the_worker_threads(
        classifier, tmp_path, monkeypatch, order, torch_threads_after):
    # torch_threads: 2. OpenVINO computes on 2 threads of its own, torch only preprocesses, on 1
    # (its spinning OpenMP threads would take OpenVINO's cores); a package computes in torch: 2.
    model_dir = model_dir_with_order(classifier, tmp_path / "m", order)
    config_path = model_dir / "model-config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["handler"]["torch_threads"] = 2
    config_path.write_text(yaml.safe_dump(config))
    calls: list[int] = []
    set_num_threads = torch.set_num_threads

    def recorded(threads: int) -> None:
        calls.append(threads)
        set_num_threads(threads)

    monkeypatch.setattr(torch, "set_num_threads", recorded)
    handler = load_classifier_dir(model_dir)
    assert handler.runner == order[0]
    *during_initialize, _restored_by_the_test = calls
    assert during_initialize[0] == 2 and during_initialize[-1] == torch_threads_after
    if isinstance(handler.classifier.run, OpenVinoRunner):
        assert engine_threads(handler.classifier.run) == threads_given(2, handler.classifier.run)
    else:
        assert order[0] == "aoti-fp32"


@pytest.fixture
def own_batch_lock(tmp_path, monkeypatch) -> Iterator[Path]:
    """The process's batch registration on a lock file of this test's own, so workers of servers
    running beside the test do not count as other workers in a batch."""
    monkeypatch.setenv(LOCK_DIR_VARIABLE, str(tmp_path))
    host_batches.cache_clear()
    yield tmp_path / LOCK_FILE_NAME
    host_batches.cache_clear()


@pytest.mark.parametrize("runner", ["openvino-fp32", "onnxruntime-fp32"])
def test_an_engine_is_loaded_again_at_solo_threads_for_batches_alone_on_the_host(
        classifier, eager_answers, tmp_path, own_batch_lock, monkeypatch, runner):
    model_dir = model_dir_with_order(classifier, tmp_path / "m", [runner])
    config_path = model_dir / "model-config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["handler"].update(torch_threads=1, solo_threads=2)
    config_path.write_text(yaml.safe_dump(config))
    calls: list[str] = []
    noting_calls(runner_selection, ("reference_answers", "check_answers"), calls, monkeypatch)
    handler = load_classifier_dir(model_dir)
    run = handler.classifier.run
    assert handler.runner == runner and isinstance(run, SoloThreadsRunner)
    # both loads are checked against the eager network's answers, computed once
    assert calls == ["reference_answers", "check_answers", "check_answers"]
    assert [engine_threads(load) for load in (run.shared, run.solo)] == [
        threads_given(1, run.shared), threads_given(2, run.solo)]
    if runner.startswith("onnxruntime"):   # no load's threads hold the cores once a run ends
        assert [spins_on_after_a_run(load) for load in (run.shared, run.solo)] == [False, False]
    assert handler.describe()["runners"]["classifier"]["solo_threads"] == 2
    ran: list[str] = []
    for name in ("shared", "solo"):
        setattr(run, name, noting(name, getattr(run, name), ran))
    alone = photo_answers(handler, PHOTOS)
    with other_worker_in_a_batch(own_batch_lock):
        beside_another = photo_answers(handler, PHOTOS)
    assert ran == ["solo", "shared"]
    for answers in (alone, beside_another):
        for got, expected in zip(answers, eager_answers, strict=True):
            assert_same_answer(got, expected, "fp32")
