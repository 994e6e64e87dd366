"""What an Ultralytics export says about itself, read when its archive is built.

`model.export(format="torchscript")` writes a TorchScript file whose `config.txt` extra file is a
JSON object, and `format="onnx"` an ONNX model whose metadata properties are strings (Python
literals for `imgsz` and `names`); both carry the task, the input size, the stride, the class
names and whether the head is end-to-end (`end2end`, or `nms` among the export's arguments: the
export answers its detections, `[batch, boxes, 6]`, and no NMS is run). `read_export` reads and
checks them, and the network's output shape on a zero image, so that a file that cannot serve
fails its build with a message saying why: no metadata (not an Ultralytics export), truncated or
unreadable, an input size the stride does not divide, a task other than detection and
classification, an output that is neither a detection head's nor an end-to-end one's. Importing
this module imports no torch; reading an export does.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchserve_vision.errors import CommandError

ExportFormat = Literal["torchscript", "onnx"]
# Ultralytics' task names -> this project's kinds.
SUPPORTED_TASKS = {"detect": "detection", "classify": "classification"}
OTHER_TASKS = ("segment", "pose", "obb")
SUPPORTED = ("detection (YOLOv8 / YOLO11 / YOLO26 `Detect` heads: [batch, 4 + classes, boxes], or "
             "end-to-end, [batch, boxes, 6]) and classification (`-cls` models)")


class ExportError(CommandError, ValueError):
    """An export that cannot make an archive: the message says what is wrong with it."""


@dataclass(frozen=True)
class UltralyticsExport:
    """An export's file and what it says: `task` (a project kind: detection or classification),
    `input_hw` (its imgsz), `stride`, `names` (class names by index), `fixed_batch` (an ONNX
    model's batch size when its batch dimension is fixed; None: any), `version` (Ultralytics'),
    `end_to_end` (a detector that answers its detections: no NMS to run)."""

    path: Path
    format: ExportFormat
    task: str
    input_hw: tuple[int, int]
    stride: int
    names: tuple[str, ...]
    fixed_batch: int | None
    version: str | None
    end_to_end: bool = False


def export_format(path: Path) -> ExportFormat:
    """TorchScript (`.torchscript`, Ultralytics' suffix, or any other) or ONNX (`.onnx`)."""
    return "onnx" if path.suffix.lower() == ".onnx" else "torchscript"


def read_export(path: Path) -> UltralyticsExport:
    """The export at `path`, checked (ExportError for anything that cannot serve)."""
    if not path.is_file():
        raise ExportError(f"model file not found: {path}")
    file_format = export_format(path)
    if file_format == "onnx":
        metadata, fixed_batch, run = _onnx_export(path)
    else:
        metadata, fixed_batch, run = _torchscript_export(path)
    export = _checked(path, file_format, metadata, fixed_batch)
    output_shape = run(export.input_hw)
    _check_output(export, metadata, output_shape)
    return export


def _torchscript_export(path: Path) -> tuple[Mapping[str, Any], int | None, Any]:
    import torch
    import torchvision  # noqa: F401 - registers torchvision::nms, which an `nms=True` export calls

    extra = {"config.txt": ""}
    try:
        program = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file raises many kinds
        raise ExportError(f"{path} cannot be read as TorchScript (truncated, or not a TorchScript "
                          f"file?): {type(error).__name__}: {str(error).splitlines()[0][:200]}") from None
    text = extra["config.txt"]
    if not text:
        raise ExportError(f"{path} is TorchScript without Ultralytics' metadata (its `config.txt` "
                          "extra file): export it with Ultralytics' model.export(format=\"torchscript\"), "
                          "or serve it with --source torchscript")
    try:
        metadata = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise ExportError(f"{path}: its `config.txt` is not Ultralytics' JSON metadata: {error}") from None

    def output_shape(input_hw: tuple[int, int]) -> tuple[int, ...]:
        with torch.inference_mode():
            output = program.eval()(torch.zeros(1, 3, *input_hw))
        return tuple((output[0] if isinstance(output, (tuple, list)) else output).shape)

    return metadata, None, output_shape


def _onnx_export(path: Path) -> tuple[Mapping[str, Any], int | None, Any]:
    import numpy as np
    import onnxruntime

    try:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - ONNX Runtime raises its own kinds for a bad file
        raise ExportError(f"{path} cannot be read as an ONNX model (truncated, or not ONNX?): "
                          f"{type(error).__name__}: {str(error).splitlines()[0][:200]}") from None
    properties = dict(session.get_modelmeta().custom_metadata_map)
    if "task" not in properties:
        raise ExportError(f"{path} is an ONNX model without Ultralytics' metadata (task, imgsz, "
                          "stride, names): export it with Ultralytics' model.export(format=\"onnx\")")
    metadata: dict[str, Any] = dict(properties)
    for key in ("imgsz", "names", "stride", "end2end", "args"):
        if key in metadata:
            try:
                metadata[key] = ast.literal_eval(metadata[key])
            except (ValueError, SyntaxError):
                raise ExportError(f"{path}: its metadata {key!r} is not readable: "
                                  f"{metadata[key]!r}") from None
    model_input = session.get_inputs()[0]
    batch = model_input.shape[0] if model_input.shape else None
    fixed_batch = batch if isinstance(batch, int) and batch > 0 else None

    def output_shape(input_hw: tuple[int, int]) -> tuple[int, ...]:
        zeros = np.zeros((fixed_batch or 1, 3, *input_hw), dtype=np.float32)
        return tuple(session.run(None, {model_input.name: zeros})[0].shape)

    return metadata, fixed_batch, output_shape


def _checked(path: Path, file_format: ExportFormat, metadata: Mapping[str, Any],
             fixed_batch: int | None) -> UltralyticsExport:
    task = metadata.get("task")
    if task in OTHER_TASKS:
        raise ExportError(f"{path} is an Ultralytics {task} export; supported: {SUPPORTED}")
    if task not in SUPPORTED_TASKS:
        raise ExportError(f"{path}: unknown Ultralytics task {task!r}; supported: {SUPPORTED}")
    input_hw = _input_hw(path, metadata.get("imgsz"))
    stride = metadata.get("stride")
    if isinstance(stride, bool) or not isinstance(stride, int) or stride <= 0:
        raise ExportError(f"{path}: its metadata stride {stride!r} is not a positive integer")
    if task == "detect" and any(side % stride for side in input_hw):
        raise ExportError(f"{path}: its input size {list(input_hw)} does not divide by its stride "
                          f"{stride}; export it again with an imgsz that is a multiple of {stride}")
    arguments = metadata.get("args")
    end_to_end = task == "detect" and (_true(metadata.get("end2end"))
                                       or (isinstance(arguments, Mapping) and _true(arguments.get("nms"))))
    return UltralyticsExport(path, file_format, SUPPORTED_TASKS[task], input_hw, stride,
                             _names(path, metadata.get("names")), fixed_batch,
                             str(metadata["version"]) if "version" in metadata else None, end_to_end)


def _true(value: Any) -> bool:
    return value is True or value in ("True", "true")


def _input_hw(path: Path, value: Any) -> tuple[int, int]:
    sides = [value, value] if isinstance(value, int) else value
    if (not isinstance(sides, (list, tuple)) or len(sides) != 2
            or not all(isinstance(side, int) and not isinstance(side, bool) and side > 0 for side in sides)):
        raise ExportError(f"{path}: its metadata imgsz {value!r} is not a size ([height, width])")
    return int(sides[0]), int(sides[1])


def _names(path: Path, value: Any) -> tuple[str, ...]:
    """Ultralytics' `names` ({index: name}, indices 0..N-1) as a tuple by index."""
    if not isinstance(value, Mapping) or not value:
        raise ExportError(f"{path}: its metadata names {str(value)[:80]!r} are not a class map")
    try:
        by_index = {int(index): str(name) for index, name in value.items()}
    except (TypeError, ValueError):
        raise ExportError(f"{path}: its metadata names have keys that are not class indices") from None
    if sorted(by_index) != list(range(len(by_index))):
        raise ExportError(f"{path}: its metadata names are not numbered 0..{len(by_index) - 1}")
    return tuple(by_index[index] for index in range(len(by_index)))


def _check_output(export: UltralyticsExport, metadata: Mapping[str, Any], shape: tuple[int, ...]) -> None:
    classes = len(export.names)
    if export.task == "classification":
        if len(shape) != 2 or shape[1] != classes:
            raise ExportError(f"{export.path}: a classification export should answer [batch, {classes}] "
                              f"for its {classes} classes, it answers {list(shape)}")
        return
    if export.end_to_end:
        if len(shape) != 3 or shape[-1] != 6:
            raise ExportError(f"{export.path} says it is end-to-end, but answers {list(shape)}, not "
                              "[batch, boxes, 6]")
        return
    if len(shape) != 3 or shape[1] != 4 + classes:
        head = metadata.get("head", "its head")
        raise ExportError(f"{export.path} ({head}) answers {list(shape)}, not [batch, 4 + {classes}, boxes] "
                          f"for its {classes} classes; supported: {SUPPORTED}")


# Ultralytics' predict defaults (ultralytics/cfg/default.yaml, engine/model.py): an archive's.
PREDICT_DEFAULTS = {"score_threshold": 0.25, "iou_threshold": 0.7, "max_detections": 300}
MAX_DETECTIONS_CAP = 1000
LETTERBOX_FILL = 114


def handler_options(export: UltralyticsExport) -> dict[str, Any]:
    """The `handler:` options an export implies: a detector letterboxed, NMS'd (unless it is
    end-to-end) and mapped back as Ultralytics' predict does, at its defaults, and a TorchScript
    one with a detection head also as an OpenVINO model for CPU workers
    (handlers.model.ultralytics_engine); a classifier
    resized (short side, by Pillow) and centre-cropped to the export's size as Ultralytics'
    classify preprocessing does, pixels / 255, its own probabilities as the answer. fp32, no reduced-scale
    JPEG decoding (Ultralytics decodes in full), no batch-norm folding (an export is fused
    already)."""
    if export.task == "detection":
        detection = {"output": "ultralytics", "input_size": list(export.input_hw),
                     "letterbox_fill": LETTERBOX_FILL, **PREDICT_DEFAULTS,
                     "max_detections_cap": MAX_DETECTIONS_CAP}
        if export.end_to_end:
            detection["end_to_end"] = True
        options: dict[str, Any] = {"precision": "fp32", "detection": detection}
        if export.format == "torchscript" and not export.end_to_end:
            options["compile"] = {"engines": ["openvino"]}    # the export serves where it is refused
        return options
    height, width = export.input_hw
    if height != width:
        raise ExportError(f"{export.path}: a classification export of a non-square size {[height, width]} "
                          "is not supported (Ultralytics resizes those to the exact size); export it "
                          "with a single imgsz")
    preprocess = {"resize_size": height, "input_size": height, "resize": "pillow",
                  "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}
    return {"precision": "fp32", "preprocess": preprocess,
            "output": "probabilities", "jpeg_draft": False, "channels_last": False,
            "cuda_fold_batch_norm": False}
