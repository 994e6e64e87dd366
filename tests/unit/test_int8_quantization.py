"""The int8 OpenVINO model of `compile.int8`: the gate's verdict (pure), then, on timm's tiny
test ResNet, an archive that holds the int8 model and its gate, a worker that serves it first,
and a gate that fails the build (its model left out) unless forced."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from handlers.model import model_loading
from handlers.model.compiled_model import COMPILED_DIRECTORY
from tests.answers import assert_same_answer
from tests.archives import load_classifier_dir, photo_answers, stage_model_dir
from tests.images import photo_bytes
from torchserve_vision.archives import int8_quantization
from torchserve_vision.archives.build import BuildError, stage_files
from torchserve_vision.archives.int8_quantization import INT8_FILE, Int8Gate
from torchserve_vision.model_descriptions import ModelDescription, parse_description

PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg"]
TINY_INT8 = {"calibration_images": 16, "gate_images": 16, "min_agreement": 0.0}


def gate(agreement: float, forced: bool = False) -> Int8Gate:
    return Int8Gate(0.96, agreement, 0.2, 0.01, 300, 300, ("a", "b", "c"), ("d", "e"),
                    "the project's photos", forced)


def test_the_gate_passes_at_its_agreement_and_says_what_it_measured():
    assert gate(0.96).passed and not gate(0.959).passed
    summary = gate(0.957).summary()
    assert summary.startswith("int8 gate FAILS: top-1 agreement with fp32 95.7% (at least 96.0%)")
    assert "300 variants of 2 held-out sources ['d', 'e']" in summary and "largest 0.200" in summary
    assert "FAILS (kept: forced)" in gate(0.5, forced=True).summary()
    assert gate(0.97).to_dict()["gate_sources"] == ["d", "e"]


def tiny(int8: dict | bool, version: str = "1.0") -> ModelDescription:
    """timm's tiny test ResNet with fixed-seed weights, served at fp32 (its int8 model's float
    layers in f32 on every CPU). Its int8 model moves the probe photos' answers by 0.046-0.049
    on an AMX Xeon with AMX, AVX-512 VNNI and AVX2 kernels, well inside int8's bound of 0.25.
    (timm's tiny test EfficientNet, untrained, moved one by 0.257 on AMX kernels only, and the
    worker rightly refused it there: the bound is for trained models on their subjects.)"""
    return parse_description({
        "name": "tiny", "version": version, "labels": "imagenet",
        "model": {"source": "timm", "architecture": "test_resnet", "weights": "fixed-seed:1"},
        "handler": {"preprocess": {"resize_size": 72, "input_size": 64}, "precision": "fp32",
                    "compile": {"engines": ["openvino"], "int8": int8,
                                "runner_order": {"avx512_bf16": ["openvino-int8", "openvino-bf16"],
                                                 "avx2": ["openvino-int8", "openvino-fp32"]}}}})


def staging(directory: Path) -> Path:
    directory.mkdir()
    return directory


@pytest.mark.slow
def test_an_archive_with_int8_holds_its_model_and_gate_and_a_worker_serves_it_first(tmp_path):
    model_dir = stage_model_dir(tiny(TINY_INT8), tmp_path)
    handler_yaml = yaml.safe_load((model_dir / "model-config.yaml").read_text())["handler"]
    int8_file = f"{COMPILED_DIRECTORY}/{INT8_FILE}"
    assert {"engine": "openvino", "file": int8_file, "weights": "int8"} in handler_yaml["engine_models"]
    assert (model_dir / int8_file).is_file() and (model_dir / int8_file).with_suffix(".bin").is_file()
    recorded = handler_yaml["int8_gate"]
    assert recorded["calibration_images"] == recorded["gate_images"] == 16
    assert set(recorded["calibration_sources"]).isdisjoint(recorded["gate_sources"])
    assert 0 <= recorded["agreement"] <= 1 and not recorded["forced"]
    assert handler_yaml["runner_order"]["avx2"] == ["openvino-int8", "openvino-fp32"]

    handler = load_classifier_dir(model_dir)
    choice = handler.runners["classifier"]
    assert (choice.runner, choice.file, choice.refusals) == ("openvino-int8", int8_file, ())
    assert handler.describe()["runners"]["classifier"]["precision"] == "int8"
    # The same archive with an empty order: the eager network in fp32 answers.
    config = yaml.safe_load((model_dir / "model-config.yaml").read_text())
    config["handler"]["runner_order"] = {"avx2": []}
    (model_dir / "model-config.yaml").write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_loading, "cpu_has_native_bf16", lambda: False)
        eager = load_classifier_dir(model_dir)
    assert eager.runner == "eager"
    for got, expected in zip(photo_answers(handler, PHOTOS), photo_answers(eager, PHOTOS), strict=True):
        assert_same_answer(got, expected, "int8")


@pytest.mark.slow
def test_a_failed_gate_fails_the_build_and_leaves_no_int8_model_unless_forced(tmp_path, monkeypatch):
    monkeypatch.setattr(int8_quantization, "answer_shift", lambda *args: (0.5, 0.6, 0.1))
    asked = {**TINY_INT8, "min_agreement": 0.96}
    refused = r"tiny: int8 gate FAILS: top-1 agreement with fp32 50.0%.*--force-int8"
    with pytest.raises(BuildError, match=refused):
        stage_files(tiny(asked), staging(tmp_path / "refused"))
    assert not list((tmp_path / "refused").rglob("*int8*"))
    stage_files(tiny(asked, "2.0"), staging(tmp_path / "forced"), force_int8=True)
    handler_yaml = yaml.safe_load((tmp_path / "forced" / "model-config.yaml").read_text())["handler"]
    assert handler_yaml["int8_gate"]["forced"] and handler_yaml["int8_gate"]["agreement"] == 0.5
    assert (tmp_path / "forced" / "extra" / COMPILED_DIRECTORY / INT8_FILE).is_file()


@pytest.mark.slow
def test_photos_of_a_single_scene_fail_the_build_with_the_reason(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.png").write_bytes(photo_bytes("chelsea.png"))
    with pytest.raises(BuildError, match="tiny: splitting by source needs photos of at least two scenes"):
        stage_files(tiny(TINY_INT8), staging(tmp_path / "staged"), int8_images=folder)
