"""`torchserve-vision build`: model archives from config/models.yaml (or one model from flags)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchserve_vision import paths
from torchserve_vision.archives import BUILD_TARGETS
from torchserve_vision.cli.common import model_store_flag, subcommand
from torchserve_vision.model_descriptions import (
    EXPORT_LABELS,
    SERIALIZED_NAMES,
    DescriptionError,
    ModelDescription,
    load_descriptions,
    parse_description,
    with_settings_of,
)
from torchserve_vision.model_kinds import KINDS, kind_of
from torchserve_vision.torchserve_config import config_in_sync, write_models_block

DESCRIPTION = """\
Build TorchServe model archives (.mar) into the model store.

  torchserve-vision build                        # every model in config/models.yaml
  torchserve-vision build --only efficientnet_lite0
  torchserve-vision build --only efficientnet_lite0 --version 2.0   # a new version to roll out
  torchserve-vision build --name resnet50 --source torchvision --architecture resnet50 \\
      --weights ~/resnet50.pth --labels imagenet  # one model from flags
  torchserve-vision build --name efficientnet_lite0 --version 3.0 --task cascade \
      --stages first=efficientnet_lite0-1.0 second=efficientnet_lite0-2.0  # a pipeline version
  torchserve-vision build --check-config         # config.properties' models= matches models.yaml?
  torchserve-vision build --target gpu           # for GPU workers: no CPU packages compiled
  torchserve-vision build --only efficientnet_lite0 --images ~/photos   # compile.int8 calibrated
                                                 # and gated on your photos

Each archive `<name>-<version>.mar` holds the `handlers/` package, the class names and the
handler's settings, so it is self-contained. Weights are checked against the architecture before
archiving. --write-config rewrites the `models=`/`load_models=` entries of the server configs from
the descriptions' serving settings; --check-config fails when they differ.

A classifier whose `compile.int8` is set also gets an int8 OpenVINO model, calibrated on variants
of part of the photos (the project's photos of ImageNet subjects, or every image directly in
--images DIR, each file its own source) and kept only when its top-1 agrees with the fp32 model's
on variants of the other photos at least `min_agreement` of the time (the verdict is printed);
otherwise the build fails, unless --force-int8.
"""


def register(commands: argparse._SubParsersAction) -> None:
    parser = subcommand(commands, "build",
                        "build model archives into the model store", DESCRIPTION, [model_store_flag()])
    parser.add_argument("--models", type=Path, default=paths.MODEL_DESCRIPTIONS,
                        help=f"model description YAML (default: {paths.MODEL_DESCRIPTIONS})")
    parser.add_argument("--only", nargs="*", default=None, help="build only these model names")
    parser.add_argument("--version", help="the version to build: with --only, instead of the "
                                          "description's (a new version to roll out); default 1.0 "
                                          "with --name")
    parser.add_argument("--target", choices=BUILD_TARGETS, default="cpu",
                        help="the workers that will serve the archives: gpu leaves out the "
                             "ahead-of-time compiled CPU packages, which GPU workers refuse "
                             "(the GPU image; default: cpu, servable by any worker)")
    parser.add_argument("--images", type=Path, metavar="DIR",
                        help="photos for compile.int8's calibration and gate and for the drift "
                             "reference profile (default: the project's photos of ImageNet subjects)")
    parser.add_argument("--drift-reference-requests", type=int, default=None, metavar="N",
                        help="requests the drift reference profile is recorded from (default: "
                             "192; 0: no profile; docs/monitoring.md)")
    parser.add_argument("--force-int8", action="store_true",
                        help="keep an int8 model whose answers fail the gate")
    parser.add_argument("--write-config", type=Path, nargs="*",
                        help="rewrite load_models=/models= of these configs (default: "
                             f"{' and '.join(map(str, paths.SERVER_CONFIGS))})")
    parser.add_argument("--check-config", type=Path, nargs="*",
                        help="exit 1 when these configs (default: both) disagree with the descriptions")
    single = parser.add_argument_group("one model from flags (instead of --models)")
    single.add_argument("--name")
    single.add_argument("--task", choices=sorted(KINDS),
                        help="default: an Ultralytics export's own (--source ultralytics), else "
                             "classification")
    single.add_argument("--source", choices=sorted(SERIALIZED_NAMES), default="torchvision",
                        help="ultralytics: an Ultralytics TorchScript or ONNX export, served as "
                             "Ultralytics' predict serves it; its task, input size and class names "
                             "come from the export's metadata")
    single.add_argument("--architecture", help="timm or torchvision model name, e.g. resnet50")
    single.add_argument("--weights", help="state-dict file, TorchScript / torch.export file, or an "
                                          "Ultralytics export (.torchscript, .onnx)")
    single.add_argument("--labels", help="imagenet, coco, or a labels file (default: imagenet for "
                        "classification, coco for detection, an Ultralytics export's own names)")
    single.add_argument("--num-classes", type=int)
    single.add_argument("--top-k", type=int, help="classification: classes returned")
    single.add_argument("--detection-output", choices=("torchvision", "yolo", "ultralytics"),
                        help="detection: a torchvision detector (the default), a YOLO-style "
                             "[B, 4+C, N] model, or an Ultralytics export (the default with "
                             "--source ultralytics)")
    single.add_argument("--input-size", type=int,
                        help="classification: centre-crop size; detection (yolo): square input size")
    single.add_argument("--resize-size", type=int,
                        help="classification: shorter side before the centre crop")
    single.add_argument("--mean", type=float, nargs=3, help="classification: normalisation mean (RGB)")
    single.add_argument("--std", type=float, nargs=3, help="classification: normalisation std (RGB)")
    single.add_argument("--kwargs", type=json.loads, default={},
                        help='JSON keyword arguments for the architecture builder, e.g. '
                             '\'{"box_score_thresh": 0.01}\'')
    single.add_argument("--stages", nargs="+", metavar="ROLE=ARCHIVE",
                        help="a pipeline (--task cascade: first=, second=; --task "
                             "detect_then_classify: detector=, classifier=): <name>-<version> "
                             "archives in the model store, e.g. first=efficientnet_lite0-1.0")
    single.add_argument("--fresh", action="store_true",
                        help="do not take the handler and serving settings of the --models entry "
                             "of the same --name (by default a new version keeps them)")
    parser.set_defaults(run=run)


def pipeline_from_flags(args: argparse.Namespace) -> ModelDescription:
    stages = dict(stage.split("=", 1) for stage in args.stages or [] if "=" in stage)
    if len(stages) != len(args.stages or []):
        raise DescriptionError("--stages takes ROLE=ARCHIVE pairs, e.g. first=efficientnet_lite0-1.0")
    return parse_description({"name": args.name, "version": args.version or "1.0",
                              "task": flag_task(args), "stages": stages})


def flag_task(args: argparse.Namespace) -> str:
    """--task, else an Ultralytics export's own (read from its metadata), else classification."""
    if args.task:
        return str(args.task)
    if args.source == "ultralytics" and args.weights:
        from torchserve_vision.archives.ultralytics_exports import read_export

        return read_export(Path(args.weights).expanduser()).task
    return "classification"


def description_from_flags(args: argparse.Namespace) -> ModelDescription:
    task = flag_task(args)
    kind = kind_of(task)
    if kind.is_pipeline:
        return pipeline_from_flags(args)
    ultralytics = args.source == "ultralytics"
    options: dict[str, Any] = {}
    if args.top_k:
        options["top_k"] = args.top_k
    if kind.network == "detector":
        options["detection"] = {}
        if args.detection_output or not ultralytics:    # an export's is implied by it
            options["detection"]["output"] = args.detection_output or "torchvision"
        if args.input_size:
            options["detection"]["input_size"] = args.input_size
    else:
        preprocess = {"input_size": args.input_size, "resize_size": args.resize_size,
                      "mean": args.mean, "std": args.std}
        if any(value is not None for value in preprocess.values()):
            options["preprocess"] = {k: v for k, v in preprocess.items() if v is not None}
    labels = args.labels or (EXPORT_LABELS if ultralytics else kind.default_labels)
    return parse_description({
        "name": args.name, "version": args.version or "1.0", "task": task, "labels": labels,
        "model": {"source": args.source, "architecture": args.architecture,
                  "weights": args.weights, "num_classes": args.num_classes, "kwargs": args.kwargs},
        "handler": options,
    })


def settings_base(built: ModelDescription, models: Path) -> ModelDescription | None:
    """Whose settings a model built from flags takes: the described model of the same name and
    task, else (a pipeline) the first described model of its task, else none."""
    described = load_descriptions(models) if models.is_file() else []
    same_name = [d for d in described if d.name == built.name and d.task == built.task]
    same_task = [d for d in described if d.task == built.task] if built.is_pipeline else []
    candidates = same_name or same_task
    return candidates[0] if candidates else None


def chosen_descriptions(args: argparse.Namespace) -> list[ModelDescription]:
    if args.name:
        if not args.weights and not kind_of(args.task or "classification").is_pipeline:
            raise DescriptionError("--weights is required with --name")
        built = description_from_flags(args)
        base = None if args.fresh else settings_base(built, args.models)
        if base is None:
            return [built]
        print(f"{built.name}: handler and serving settings of {base.name} in {args.models} "
              "(--fresh to start from defaults)", flush=True)
        return [with_settings_of(built, base)]
    descriptions = load_descriptions(args.models)
    chosen = [d for d in descriptions if args.only is None or d.name in args.only]
    if args.only and len(chosen) != len(set(args.only)):
        raise DescriptionError(f"--only names not in {args.models}: "
                               f"{sorted(set(args.only) - {d.name for d in chosen})}")
    if args.version:
        if not args.only:
            raise DescriptionError("--version needs --only (or --name): which model gets it?")
        chosen = [replace(description, version=args.version) for description in chosen]
    return chosen


def show_build_log() -> None:
    """The builder's own lines (the int8 gate's verdict) on stdout, nothing from the libraries."""
    log = logging.getLogger("torchserve_vision.archives")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def run(args: argparse.Namespace) -> int:
    if args.check_config is not None:
        descriptions = load_descriptions(args.models)
        results = {path: config_in_sync(path, descriptions)
                   for path in args.check_config or paths.SERVER_CONFIGS}
        for path, in_sync in results.items():
            print(f"{path}: {'in sync' if in_sync else 'OUT OF SYNC'} with {args.models}")
        return 0 if all(results.values()) else 1

    from torchserve_vision.archives.build import build_archive  # torch: only to build

    show_build_log()
    reference = ({} if args.drift_reference_requests is None
                 else {"reference_requests": args.drift_reference_requests})
    for description in chosen_descriptions(args):
        built = build_archive(description, args.model_store, args.target, args.images, args.force_int8,
                              **reference)
        print(f"built {built}", flush=True)
    if args.write_config is not None:
        descriptions = load_descriptions(args.models)
        for path in args.write_config or paths.SERVER_CONFIGS:
            write_models_block(path, descriptions)
            print(f"wrote load_models/models of {path}")
    return 0
