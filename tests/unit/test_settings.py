from __future__ import annotations

import pytest

from handlers.ground.limits import SettingsError
from handlers.model.settings import (
    CompileSettings,
    Int8Settings,
    parse_classifier_settings,
    parse_compile,
    parse_detector_settings,
    parse_log_batches,
    parse_solo_threads,
    parse_torch_threads,
)

MINIMAL = {"model": {"source": "timm", "architecture": "efficientnet_lite0"}}


def test_defaults_fill_what_is_not_given():
    settings = parse_classifier_settings(MINIMAL)
    assert (settings.input_size, settings.resize_size, settings.top_k) == (224, 256, 5)
    assert settings.precision == "fp32" and settings.compile is None and settings.compiled_packages == ()
    assert settings.limits.max_body_bytes == 6_553_500


def test_compile_true_means_the_portable_cpu_target():
    assert parse_classifier_settings({**MINIMAL, "compile": True}).compile == CompileSettings("avx2", 30.0)
    asked = {"cpu_target": "avx512", "load_timeout_s": 5}
    assert parse_classifier_settings({**MINIMAL, "compile": asked}).compile == CompileSettings("avx512", 5.0)


def test_compile_builds_every_engine_unless_told_and_the_archive_records_models_and_order():
    assert CompileSettings().engines == ("aoti", "openvino", "onnxruntime")
    only = parse_classifier_settings({**MINIMAL, "compile": {"engines": ["onnxruntime"]}})
    assert only.compile is not None and only.compile.engines == ("onnxruntime",)
    built = parse_classifier_settings({**MINIMAL, "engine_models": [
        {"engine": "onnxruntime", "file": "compiled/model.onnx"}],
        "runner_order": {"avx2": ["onnxruntime-fp32", "aoti-fp32"]}})
    runners = built.archive_runners
    assert runners.engine_file("onnxruntime", "fp32") == "compiled/model.onnx"
    assert runners.engine_file("openvino", "fp32") is None
    assert [str(name) for name in runners.order_table()["avx2"]] == ["onnxruntime-fp32", "aoti-fp32"]


DETECTOR = {"model": {"source": "torchvision", "architecture": "ssdlite320_mobilenet_v3_large"}}


def test_a_detectors_compile_builds_its_backbone_and_head_for_openvino_and_onnx_runtime_only():
    assert parse_detector_settings(DETECTOR).compile is None
    assert parse_detector_settings({**DETECTOR, "compile": True}).compile == CompileSettings(
        engines=("openvino", "onnxruntime"))
    only = parse_detector_settings({**DETECTOR, "compile": {"engines": ["onnxruntime"], "load_timeout_s": 9}})
    assert only.compile == CompileSettings(engines=("onnxruntime",), load_timeout_s=9.0)
    for refused, message in [({"engines": ["aoti"]}, "cannot apply"), ({"int8": True}, "cannot apply")]:
        with pytest.raises(SettingsError, match=message):
            parse_detector_settings({**DETECTOR, "compile": refused})
    with pytest.raises(SettingsError, match="torchvision detectors"):
        parse_detector_settings({**DETECTOR, "compile": True, "detection": {"output": "yolo"}})
    built = parse_detector_settings({**DETECTOR, "engine_models": [
        {"engine": "openvino", "file": "compiled/model-openvino.xml"}],
        "runner_order": {"avx2": ["openvino-fp32"]}})
    assert built.archive_runners.engine_file("openvino", "fp32") == "compiled/model-openvino.xml"
    assert built.archive_runners.packages == ()


def test_int8_is_off_unless_asked_and_its_model_is_found_by_its_weights():
    assert parse_compile(True) == CompileSettings() and CompileSettings().int8 is None
    assert parse_compile({"int8": {"min_agreement": 0.98}}) == CompileSettings(
        int8=Int8Settings(min_agreement=0.98))
    assert parse_compile({"int8": True}) == CompileSettings(int8=Int8Settings())
    built = parse_classifier_settings({**MINIMAL, "engine_models": [
        {"engine": "openvino", "file": "compiled/model-openvino.xml"},
        {"engine": "openvino", "file": "compiled/model-openvino-int8.xml", "weights": "int8"}]})
    runners = built.archive_runners
    assert runners.engine_file("openvino", "bf16") == "compiled/model-openvino.xml"
    assert runners.engine_file("openvino", "fp32") == "compiled/model-openvino.xml"
    assert runners.engine_file("openvino", "int8") == "compiled/model-openvino-int8.xml"


@pytest.mark.parametrize(("extra", "message"), [
    ({"precision": "int3"}, "precision"),
    ({"top_k": 0}, "top_k"),
    ({"preprocess": {"input_size": 300, "resize_size": 256}}, "resize_size"),
    ({"preprocess": {"mean": [0.5, 0.5]}}, "preprocess.mean"),
    ({"preprocess": {"std": [0.5, 0.0, 0.5]}}, "preprocess.std"),
    ({"compile": "fastest"}, "compile"),
    ({"compile": "default"}, "never runs torch.compile"),
    ({"compile": {"cpu_target": "sse2"}}, "compile.cpu_target"),
    ({"compile": {"load_timeout_s": 0}}, "compile.load_timeout_s"),
    ({"compiled_packages": [{"file": "x.pt2"}]}, "compiled_packages"),
    ({"compile": {"engines": []}}, "compile.engines"),
    ({"compile": {"engines": ["tensorrt"]}}, "unknown engine 'tensorrt'"),
    ({"compile": {"engines": ["aoti", "aoti"]}}, "names an engine twice"),
    ({"compile": {"runner_order": {"avx2": ["onnxruntime-bf16"]}}}, "compile.runner_order"),
    ({"runner_order": {"avx512_bf16": ["aoti-bf16"]}}, "needs an 'avx2' row"),
    ({"engine_models": [{"engine": "aoti", "file": "m.pt2"}]}, "engine_models"),
    ({"engine_models": [{"file": "m.onnx"}]}, "engine_models"),
    ({"engine_models": [{"engine": "openvino", "file": "m.xml", "weights": "int4"}]}, "unknown weights"),
    ({"compile": {"int8": "yes"}}, "compile.int8"),
    ({"compile": {"int8": {"min_agreement": 96}}}, "compile.int8.min_agreement"),
    ({"compile": {"int8": {"calibration_images": 0}}}, "compile.int8.calibration_images"),
    ({"compile": {"int8": {"gate": 0.9}}}, "compile.int8"),
    ({"compile": {"int8": True, "engines": ["aoti", "onnxruntime"]}}, "add 'openvino'"),
    ({"limits": {"max_pixels": -1}}, "limits.max_pixels"),
])
def test_bad_values_name_the_setting(extra, message):
    with pytest.raises(SettingsError, match=message):
        parse_classifier_settings({**MINIMAL, **extra})


def test_missing_model_section_and_architecture_are_reported():
    with pytest.raises(SettingsError, match=r"handler\.model"):
        parse_classifier_settings({"top_k": 3})
    with pytest.raises(SettingsError, match="architecture"):
        parse_classifier_settings({"model": {"source": "torchvision"}})
    with pytest.raises(SettingsError, match="no 'handler:' section"):
        parse_classifier_settings(None)


def test_serving_options_of_the_base_handler():
    assert parse_torch_threads({}) is None and parse_torch_threads({"torch_threads": 1}) == 1
    assert parse_log_batches({}) is True and parse_log_batches({"log_batches": False}) is False
    with pytest.raises(SettingsError, match="torch_threads"):
        parse_torch_threads({"torch_threads": 0})
    with pytest.raises(SettingsError, match="log_batches"):
        parse_log_batches({"log_batches": "no"})


def test_solo_threads_are_at_least_the_workers_own():
    assert parse_solo_threads({}) is None
    assert parse_solo_threads({"solo_threads": 2}) == 2
    assert parse_solo_threads({"torch_threads": 2, "solo_threads": 2}) == 2
    with pytest.raises(SettingsError, match=r"'solo_threads' \(1\) must be at least 'torch_threads' \(2\)"):
        parse_solo_threads({"torch_threads": 2, "solo_threads": 1})
    with pytest.raises(SettingsError, match="solo_threads"):
        parse_solo_threads({"solo_threads": 0})


ULTRALYTICS = {"model": {"source": "ultralytics"}}


def test_an_ultralytics_detector_takes_any_input_size_and_may_be_end_to_end():
    detection = {"output": "ultralytics", "input_size": [480, 640], "end_to_end": True}
    settings = parse_detector_settings({**ULTRALYTICS, "detection": detection})
    assert (settings.output_format, settings.input_hw, settings.end_to_end) == ("ultralytics", (480, 640),
                                                                                True)
    assert not settings.runs_nms
    detection = {"output": "ultralytics", "input_size": 640}
    square = parse_detector_settings({**ULTRALYTICS, "detection": detection})
    assert square.input_hw == (640, 640) and square.runs_nms
    assert not parse_detector_settings(DETECTOR).runs_nms                  # a torchvision detector's own


@pytest.mark.parametrize(("detection", "message"), [
    ({"output": "yolo", "input_size": [480, 640]}, "letterboxes to a square input"),
    ({"output": "torchvision", "end_to_end": True}, r"end_to_end' applies to Ultralytics exports"),
    ({"output": "ultralytics", "input_size": [640]}, r"input_size' must be a positive integer"),
    ({"output": "ultralytics", "input_size": [0, 640]}, r"input_size' must be a positive integer"),
])
def test_detector_geometry_that_cannot_serve_is_refused(detection, message):
    with pytest.raises(SettingsError, match=message):
        parse_detector_settings({**ULTRALYTICS, "detection": detection})


def test_a_classifier_may_answer_its_own_probabilities_and_resize_as_pillow():
    settings = parse_classifier_settings({**ULTRALYTICS, "output": "probabilities",
                                          "preprocess": {"resize": "pillow"}})
    assert (settings.output, settings.resize) == ("probabilities", "pillow")
    assert (parse_classifier_settings(MINIMAL).output, parse_classifier_settings(MINIMAL).resize) == (
        "logits", "torchvision")
    with pytest.raises(SettingsError, match=r"'preprocess\.resize' must be one of torchvision, pillow"):
        parse_classifier_settings({**MINIMAL, "preprocess": {"resize": "opencv"}})
