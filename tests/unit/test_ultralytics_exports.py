"""Ultralytics exports served as Ultralytics' own `predict` answers: one build command reads the
export's metadata; bad exports get a message and no traceback; the handler's answers, in
batches of photos of every shape, are Ultralytics' own on the same file (detection: YOLOv8n and
YOLO11n, TorchScript and ONNX, and an end-to-end YOLO26n; classification: YOLOv8n-cls). The
networks are built from Ultralytics' yaml files and calibrated (tests/ultralytics_models.py);
nothing is downloaded."""

from __future__ import annotations

import base64
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from tests.archives import archive_context, extract_archive, load_classifier, load_detector, stage_model_dir
from tests.ultralytics_models import (
    assert_ultralytics_answer,
    comparison_photos,
    offline_ultralytics,
)
from torchserve_vision.cli import main as command
from torchserve_vision.model_descriptions import parse_description

pytestmark = pytest.mark.slow
DETECTORS = ["yolov8n.torchscript", "yolov8n.onnx", "yolo11n.torchscript", "yolo26n-end2end.torchscript"]


def built(export: Path, store: Path, *flags: str) -> int:
    return command(["build", "--name", "yolo", "--source", "ultralytics", "--weights", str(export),
                    "--model-store", str(store), "--drift-reference-requests", "0", *flags])


def archive_yaml(mar: Path) -> dict[str, Any]:
    with zipfile.ZipFile(mar) as archive:
        return yaml.safe_load(archive.read("model-config.yaml"))


def archive_labels(mar: Path) -> list[str]:
    with zipfile.ZipFile(mar) as archive:
        return json.loads(archive.read("labels.json"))


@pytest.fixture(scope="module")
def photo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("photos")
    files = {}
    for name, data in comparison_photos().items():
        files[name] = folder / name
        files[name].write_bytes(data)
    return files


@pytest.fixture(scope="module")
def handlers_of(ultralytics_exports, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each export's archive (built by the command), loaded as a worker loads it."""
    loaded: dict[str, Any] = {}
    for name in [*DETECTORS, "yolov8n-cls.torchscript", "yolov8n-cls.onnx"]:
        store = tmp_path_factory.mktemp("store")
        assert built(ultralytics_exports[name], store) == 0
        (mar,) = store.glob("*.mar")
        model_dir = extract_archive(mar, tmp_path_factory.mktemp("extracted"))
        loaded[name] = (load_classifier(mar, tmp_path_factory.mktemp("cls")) if "-cls" in name
                        else load_detector(model_dir, batch_size=8))
    return loaded


def answers(handler: Any, bodies: list[bytes], **options: Any) -> list[Any]:
    """One batch of requests (JSON bodies with `options`), every one a 200."""
    rows = [{"body": {"data": base64.b64encode(body).decode(), **options}} for body in bodies]
    context = archive_context(handler.model_dir, request_headers=[{} for _ in rows])
    replies = [json.loads(reply) for reply in handler.handle(rows, context)]
    assert all(context.status(index) == 200 for index in range(len(rows))), replies
    return replies


def test_the_build_reads_task_size_and_names_from_the_export(ultralytics_exports, tmp_path, capsys):
    for name, task in [("yolov8n.torchscript", "detection"), ("yolov8n.onnx", "detection"),
                       ("yolov8n-cls.torchscript", "classification")]:
        store = tmp_path / name
        assert built(ultralytics_exports[name], store) == 0, capsys.readouterr().err
        (mar,) = store.glob("*.mar")
        described = archive_yaml(mar)["handler"]
        with zipfile.ZipFile(mar) as archive:
            manifest = json.loads(archive.read("MAR-INF/MANIFEST.json"))["model"]
        assert described["model"]["source"] == "ultralytics"
        assert manifest["serializedFile"] == ("model.onnx" if name.endswith(".onnx") else "model.ts.pt")
        assert manifest["handler"] == ("object_detector.py" if task == "detection" else "image_classifier.py")
        if task == "detection":
            assert archive_labels(mar) == [str(index) for index in range(80)]     # the export's names
            assert described["detection"] == {
                "output": "ultralytics", "input_size": [640, 640], "letterbox_fill": 114,
                "score_threshold": 0.25, "iou_threshold": 0.7, "max_detections": 300,
                "max_detections_cap": 1000}
        else:
            assert len(archive_labels(mar)) == 1000
            assert described["preprocess"] == {"resize_size": 224, "input_size": 224, "resize": "pillow",
                                               "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}
            assert described["output"] == "probabilities" and described["jpeg_draft"] is False


def test_an_end_to_end_export_is_served_without_nms(ultralytics_exports, tmp_path):
    assert built(ultralytics_exports["yolo26n-end2end.torchscript"], tmp_path) == 0
    (mar,) = tmp_path.glob("*.mar")
    assert archive_yaml(mar)["handler"]["detection"]["end_to_end"] is True


def test_labels_override_the_exports_and_a_contradicting_flag_stops_the_build(ultralytics_exports,
                                                                              tmp_path, capsys):
    export = ultralytics_exports["yolov8n.torchscript"]
    names = tmp_path / "names.txt"
    names.write_text("\n".join(f"thing {index}" for index in range(80)))
    assert built(export, tmp_path / "named", "--labels", str(names)) == 0
    assert archive_labels(next((tmp_path / "named").glob("*.mar")))[:2] == ["thing 0", "thing 1"]
    assert built(export, tmp_path / "sized", "--input-size", "640") == 0     # what the export says
    capsys.readouterr()
    short = tmp_path / "short.txt"
    short.write_text("\n".join(f"thing {index}" for index in range(79)))
    for flags, message in [
        (["--labels", str(short)], "79 labels for the export's 80 classes"),
        (["--task", "classification"], "the description says task 'classification', but yolov8n.torchscript "
                                       "is an Ultralytics detection export"),
        (["--detection-output", "yolo"], "'detection.output: yolo' contradicts the export (ultralytics)"),
        (["--input-size", "320"], "'detection.input_size: 320' contradicts the export ([640, 640])"),
    ]:
        assert built(export, tmp_path / "refused", *flags) == 1
        error = capsys.readouterr().err
        assert message in error and "Traceback" not in error, error
    assert not list((tmp_path / "refused").glob("*.mar"))


class Tiny(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def resaved_with_metadata(export: Path, target: Path, **changes: Any) -> Path:
    """The TorchScript export saved again with its `config.txt` metadata changed."""
    extra = {"config.txt": ""}
    program = torch.jit.load(str(export), _extra_files=extra)
    metadata = {**json.loads(extra["config.txt"]), **changes}
    torch.jit.save(program, str(target), _extra_files={"config.txt": json.dumps(metadata)})
    return target


def test_bad_exports_get_a_message_saying_what_is_wrong_and_no_traceback(ultralytics_exports, tmp_path,
                                                                          capsys):
    plain = tmp_path / "plain.torchscript"
    torch.jit.save(torch.jit.trace(Tiny(), torch.zeros(1, 3, 32, 32)), str(plain))
    plain_onnx = tmp_path / "plain.onnx"
    torch.onnx.export(Tiny(), (torch.zeros(1, 3, 32, 32),), str(plain_onnx), dynamo=False)
    truncated = tmp_path / "truncated.torchscript"
    data = ultralytics_exports["yolov8n.torchscript"].read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    truncated_onnx = tmp_path / "truncated.onnx"
    data = ultralytics_exports["yolov8n.onnx"].read_bytes()
    truncated_onnx.write_bytes(data[: len(data) // 2])
    odd_size = resaved_with_metadata(ultralytics_exports["yolov8n.torchscript"], tmp_path / "odd.torchscript",
                                     imgsz=[650, 650])
    cases = [
        (plain, "is TorchScript without Ultralytics' metadata"),
        (plain_onnx, "is an ONNX model without Ultralytics' metadata"),
        (truncated, "cannot be read as TorchScript (truncated, or not a TorchScript file?)"),
        (truncated_onnx, "cannot be read as an ONNX model (truncated, or not ONNX?)"),
        (odd_size, "its input size [650, 650] does not divide by its stride 32"),
        (tmp_path / "missing.torchscript", "model file not found"),
    ]
    for task, name in (("seg", "segment"), ("pose", "pose"), ("obb", "obb")):
        cases.append((ultralytics_exports[f"yolov8n-{task}.torchscript"],
                      f"is an Ultralytics {name} export; supported: detection"))
    for export, message in cases:
        assert built(export, tmp_path / "store") == 1, export
        error = capsys.readouterr().err
        assert message in error and "Traceback" not in error, (export, error)
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").glob("*.mar"))


@pytest.mark.parametrize("name", DETECTORS)
def test_detections_are_ultralytics_own_in_batches_of_every_shape(name, handlers_of, ultralytics_exports,
                                                                  photo_files):
    """The eight photos as one batch (in the worker's chunks of 8), at the archive's defaults,
    at a low threshold, and with class-agnostic NMS; Ultralytics' predict on each file alone."""
    handler = handlers_of[name]
    bodies = [path.read_bytes() for path in photo_files.values()]
    cases: list[tuple[dict[str, Any], dict[str, Any], float]] = [
        ({}, {}, 0.25), ({"score_threshold": 0.05}, {"conf": 0.05}, 0.05)]
    if "end2end" not in name:
        cases.append(({"agnostic_nms": True, "score_threshold": 0.1},
                      {"agnostic_nms": True, "conf": 0.1}, 0.1))
    with offline_ultralytics():
        from ultralytics import YOLO

        reference: Any = YOLO(str(ultralytics_exports[name]), task="detect")
        found = 0
        for options, predict_options, threshold in cases:
            served = answers(handler, bodies, **options)
            nms = "none" if "end2end" in name else "agnostic" if options.get("agnostic_nms") else "per class"
            for answer, path in zip(served, photo_files.values(), strict=True):
                result = reference.predict(str(path), verbose=False, **predict_options)[0]
                assert_ultralytics_answer(answer, result, threshold, nms)
                found += len(answer)
    assert found > 100, "the calibrated network found too little to compare"


@pytest.mark.parametrize("name", ["yolov8n-cls.torchscript", "yolov8n-cls.onnx"])
def test_a_classification_export_gives_ultralytics_top_5(name, handlers_of, ultralytics_exports, photo_files):
    handler = handlers_of[name]
    served = answers(handler, [path.read_bytes() for path in photo_files.values()])
    with offline_ultralytics():
        from ultralytics import YOLO

        reference: Any = YOLO(str(ultralytics_exports[name]), task="classify")
        for answer, path in zip(served, photo_files.values(), strict=True):
            probs = reference.predict(str(path), verbose=False)[0].probs
            assert [row["index"] for row in answer] == list(probs.top5), path.name
            assert max(abs(row["probability"] - float(expected))
                       for row, expected in zip(answer, probs.top5conf, strict=True)) <= CLASSIFY_BOUND
    assert max(answer[0]["probability"] for answer in served) > 0.5


# Both sides resize with Pillow and normalise in float32 (the archive multiplies by 1 / 255 where
# Ultralytics divides, a last-bit difference), in batches of different sizes.
CLASSIFY_BOUND = 1e-4


def test_a_request_cannot_ask_an_end_to_end_export_for_class_agnostic_nms(handlers_of, photo_files):
    handler = handlers_of["yolo26n-end2end.torchscript"]
    row = {"body": {"data": base64.b64encode(photo_files["astronaut.png"].read_bytes()).decode(),
                    "agnostic_nms": True}}
    context = archive_context(handler.model_dir, request_headers=[{}])
    reply = json.loads(handler.handle([row], context)[0])
    assert context.status(0) == 400 and reply["type"] == "InvalidParameter", reply
    assert "end-to-end" in reply["message"]


def test_a_torchscript_export_is_served_by_its_checked_openvino_model_an_onnx_one_by_itself(handlers_of):
    runners = {name: handlers_of[name].describe()["runners"]["detector"] for name in DETECTORS}
    assert runners["yolov8n.torchscript"]["runner"] == "openvino-fp32"
    assert runners["yolo11n.torchscript"]["runner"] == "openvino-fp32"
    assert runners["yolov8n.onnx"]["runner"] == "eager" and "refused" not in runners["yolov8n.onnx"]
    assert runners["yolo26n-end2end.torchscript"]["runner"] == "eager"


def test_an_openvino_model_that_answers_otherwise_is_refused_and_the_export_serves(ultralytics_exports,
                                                                                   tmp_path):
    """YOLO11n's OpenVINO model put in YOLOv8n's archive: the same output shape, other outputs."""
    dirs = {}
    for name in ("yolov8n.torchscript", "yolo11n.torchscript"):
        description = parse_description({"name": "yolo", "task": "detection", "model": {
            "source": "ultralytics", "weights": str(ultralytics_exports[name])}})
        (tmp_path / name).mkdir()
        dirs[name] = stage_model_dir(description, tmp_path / name)
    for suffix in ("xml", "bin"):
        shutil.copy(dirs["yolo11n.torchscript"] / "compiled" / f"model-openvino.{suffix}",
                    dirs["yolov8n.torchscript"] / "compiled" / f"model-openvino.{suffix}")
    runner = load_detector(dirs["yolov8n.torchscript"]).describe()["runners"]["detector"]
    assert runner["runner"] == "eager"
    (refusal,) = runner["refused"]
    assert refusal["runner"] == "openvino-fp32" and refusal["reason"] == "wrong_output"
    assert "differ from the export's" in refusal["message"]


def test_the_shadow_stage_compares_two_exports_answers_box_by_box(handlers_of, photo_files):
    """What a shadow candidate is held to (handlers.shadow): the TorchScript and the ONNX export
    of one network agree on every photo; YOLO11n, another network, does not."""
    bodies = [path.read_bytes() for path in photo_files.values()]
    ours = answers(handlers_of["yolov8n.torchscript"], bodies, score_threshold=0.05)
    same = answers(handlers_of["yolov8n.onnx"], bodies, score_threshold=0.05)
    other = answers(handlers_of["yolo11n.torchscript"], bodies, score_threshold=0.05)
    compare = handlers_of["yolov8n.torchscript"].compare_answers
    assert min(compare(a, b).agreement for a, b in zip(ours, same, strict=True)) > 0.95
    assert min(compare(a, b).agreement for a, b in zip(ours, other, strict=True)) < 0.5
