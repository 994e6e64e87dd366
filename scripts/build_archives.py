"""Build TorchServe model archives (.mar) from short declarative model descriptions.

    python scripts/build_archives.py                      # every model in config/models.yaml
    python scripts/build_archives.py --only efficientnet_lite0
    python scripts/build_archives.py --name resnet50 --source torchvision --architecture resnet50 \\
        --weights ~/resnet50.pth --labels imagenet        # one model from flags

Each archive `<name>-<version>.mar` lands in the model store with the `handlers/` package, the
class names and the handler's settings inside it, so it is self-contained. Weights are checked
against the architecture before archiving; any problem stops the build with a message.
`--write-config` rewrites the `models=`/`load_models=` entries of config.properties from the
descriptions' serving settings; `--check-config` fails when they differ.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from handlers.compiled_model import CompiledPackage  # noqa: E402
from handlers.model_loading import create_architecture, load_model, load_state_dict_model  # noqa: E402
from handlers.settings import (  # noqa: E402
    ModelSource,
    SettingsError,
    parse_classifier_settings,
    parse_compile,
    parse_detector_settings,
    parse_model_source,
)
from scripts.compile_ahead import CompileRequest, compile_packages  # noqa: E402
from scripts.fixed_seed_weights import fixed_seed_model  # noqa: E402
from scripts.pretrained_weights import WeightsError, packaged_state_dict  # noqa: E402
from scripts.rollout import ServingSettings  # noqa: E402
from scripts.torchserve_config import models_property  # noqa: E402

DEFAULT_DESCRIPTIONS = REPO_ROOT / "config" / "models.yaml"
DEFAULT_MODEL_STORE = REPO_ROOT / "model_store"
DEFAULT_CONFIG = REPO_ROOT / "config" / "config.properties"
PRODUCTION_CONFIG = REPO_ROOT / "config" / "config.production.properties"
DEFAULT_CONFIGS = (DEFAULT_CONFIG, PRODUCTION_CONFIG)
HANDLER_PACKAGE = REPO_ROOT / "handlers"
ENTRY_MODULES = {"classification": "image_classifier.py", "detection": "object_detector.py"}
SETTINGS_PARSERS: dict[str, Callable[[Mapping[str, Any]], object]] = {
    "classification": parse_classifier_settings,
    "detection": parse_detector_settings,
}
SERIALIZED_NAMES = {"timm": "model.pt", "torchvision": "model.pt", "torchscript": "model.ts.pt",
                    "export": "model.pt2"}


class BuildError(RuntimeError):
    """A description or its files cannot make a working archive."""


@dataclass(frozen=True)
class ModelDescription:
    name: str
    version: str
    task: str
    source: str
    architecture: str | None
    weights: str
    labels: str
    num_classes: int | None = None
    builder_kwargs: Mapping[str, Any] = field(default_factory=dict)
    handler_options: Mapping[str, Any] = field(default_factory=dict)
    serving: ServingSettings = field(default_factory=ServingSettings)

    @property
    def archive_name(self) -> str:
        return f"{self.name}-{self.version}.mar"


# --- descriptions -----------------------------------------------------------------------------
def parse_description(raw: Mapping[str, Any]) -> ModelDescription:
    """One entry of models.yaml -> ModelDescription; BuildError naming what is missing or wrong."""
    try:
        model = raw["model"]
        description = ModelDescription(
            name=str(raw["name"]),
            version=str(raw.get("version", "1.0")),
            task=str(raw.get("task", "classification")),
            source=str(model["source"]),
            architecture=model.get("architecture"),
            weights=str(model["weights"]),
            labels=str(raw["labels"]),
            num_classes=model.get("num_classes"),
            builder_kwargs=dict(model.get("kwargs") or {}),
            handler_options=dict(raw.get("handler", {})),
            serving=ServingSettings(**raw.get("serving", {})),
        )
    except KeyError as error:
        raise BuildError(f"model description {raw.get('name', '?')!r} lacks {error}") from None
    except TypeError as error:
        raise BuildError(f"model description {raw.get('name', '?')!r}: {error}") from None
    if description.task not in ENTRY_MODULES:
        raise BuildError(f"{description.name}: unknown task {description.task!r}; "
                         f"known: {', '.join(ENTRY_MODULES)}")
    return description


def load_descriptions(path: Path) -> list[ModelDescription]:
    if not path.is_file():
        raise BuildError(f"no model description file at {path}")
    document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return [parse_description(raw) for raw in document.get("models", [])]


# --- labels -------------------------------------------------------------------------------------
def resolve_labels(spec: str) -> list[str]:
    """`imagenet` / `coco`: class names from torchvision's weight metadata; else a labels file."""
    if spec == "imagenet":
        from torchvision.models import ResNet50_Weights

        return list(ResNet50_Weights.DEFAULT.meta["categories"])
    if spec == "coco":
        from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights

        return list(FasterRCNN_ResNet50_FPN_Weights.DEFAULT.meta["categories"])
    path = Path(spec).expanduser()
    if not path.is_file():
        raise BuildError(f"labels file not found: {path} (or use 'imagenet' / 'coco')")
    from handlers.model_loading import load_labels

    try:
        return load_labels(path)
    except ValueError as error:
        raise BuildError(str(error)) from None


# --- weights ------------------------------------------------------------------------------------
def unwrap_checkpoint(checkpoint: Any) -> dict[str, torch.Tensor]:
    """A state dict, or one nested under 'state_dict' / 'model' as training scripts save it."""
    for key in ("state_dict", "model"):
        if isinstance(checkpoint, dict) and isinstance(checkpoint.get(key), dict):
            checkpoint = checkpoint[key]
    if not isinstance(checkpoint, dict) or not all(torch.is_tensor(v) for v in checkpoint.values()):
        raise BuildError("the weights file does not hold a state dict of tensors")
    return checkpoint


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise BuildError(f"weights file not found: {path}")
    try:
        return unwrap_checkpoint(torch.load(path, map_location="cpu", weights_only=True))
    except (RuntimeError, OSError, ValueError) as error:
        raise BuildError(f"cannot read weights file {path}: {error}") from None


def model_source(description: ModelDescription, num_classes: int | None) -> ModelSource:
    """The description's network, checked by the handler's own parser."""
    try:
        return parse_model_source({"source": description.source,
                                   "architecture": description.architecture,
                                   "num_classes": num_classes,
                                   "kwargs": dict(description.builder_kwargs)})
    except SettingsError as error:
        raise BuildError(f"{description.name}: {error}") from None


def fixed_seed_state_dict(description: ModelDescription, num_classes: int) -> dict[str, torch.Tensor]:
    """`fixed-seed:N`: the architecture under seed N, calibrated so answers differ per image."""
    try:
        seed = int(description.weights.split(":", 1)[1])
    except ValueError:
        raise BuildError(f"{description.name}: 'fixed-seed:N' needs an integer seed, "
                         f"got {description.weights!r}") from None
    source = model_source(description, num_classes)
    model = fixed_seed_model(lambda: create_architecture(source), seed,
                             detector=description.task == "detection")
    return model.state_dict()


def write_state_dict(description: ModelDescription, num_classes: int, target: Path) -> None:
    """Resolve, check against the architecture (strict: every key, every shape), and save.

    `weights` is a state-dict file, `package:NAME` (real weights shipped in a package) or
    `fixed-seed:N` (the architecture's own initialisation under seed N, calibrated)."""
    if description.weights.startswith("fixed-seed:"):
        state_dict: Mapping[str, torch.Tensor] = fixed_seed_state_dict(description, num_classes)
    elif description.weights.startswith("package:"):
        try:
            state_dict = packaged_state_dict(description.weights[8:])
        except WeightsError as error:
            raise BuildError(str(error)) from None
    else:
        state_dict = load_weights_file(Path(description.weights).expanduser())
    torch.save(dict(state_dict), target)
    try:
        load_state_dict_model(model_source(description, num_classes), target)
    except (RuntimeError, ValueError) as error:
        raise BuildError(f"{description.name}: the weights do not fit "
                         f"{description.source}:{description.architecture}: {error}") from None


def copy_program(description: ModelDescription, target: Path) -> None:
    """Copy a TorchScript / torch.export file after checking it loads."""
    path = Path(description.weights).expanduser()
    if not path.is_file():
        raise BuildError(f"model file not found: {path}")
    try:
        if description.source == "torchscript":
            torch.jit.load(str(path), map_location="cpu")
        else:
            torch.export.load(str(path))
    except Exception as error:  # noqa: BLE001 - any failure means the file is unusable
        raise BuildError(f"{path} is not a loadable {description.source} file: {error}") from None
    shutil.copyfile(path, target)


def check_architecture(description: ModelDescription) -> None:
    if description.source == "timm":
        import timm

        known = timm.is_model(description.architecture or "")
    elif description.source == "torchvision":
        import torchvision

        known = description.architecture in torchvision.models.list_models()
    else:
        return
    if not known:
        raise BuildError(f"{description.name}: unknown {description.source} architecture "
                         f"{description.architecture!r}")


# --- ahead-of-time compilation ---------------------------------------------------------------------
def compile_request(description: ModelDescription) -> CompileRequest | None:
    """What `compile:` asks the builder to build (None: an eager archive)."""
    try:
        settings = parse_compile(description.handler_options.get("compile"))
    except SettingsError as error:
        raise BuildError(f"{description.name}: {error}") from None
    if settings is None:
        return None
    if description.task != "classification":
        raise BuildError(f"{description.name}: 'compile' applies to classification archives only")
    if description.source == "torchscript":
        raise BuildError(f"{description.name}: a TorchScript model cannot be compiled ahead of time; "
                         "export it with torch.export (source: export) instead")
    parsed = parse_classifier_settings({**description.handler_options,
                                        "model": {"source": description.source,
                                                  "architecture": description.architecture}})
    size = parsed.input_size
    return CompileRequest(parsed.precision, settings.cpu_target, description.serving.batch_size,
                          (3, size, size), parsed.channels_last)


def compiled_packages(description: ModelDescription, request: CompileRequest | None,
                      num_classes: int | None, weights: Path, directory: Path) -> list[CompiledPackage]:
    """Build the packages `request` asks for into `directory` ([] for None)."""
    if request is None:
        return []
    model = load_model(model_source(description, num_classes), weights, torch.device("cpu"))
    try:
        return compile_packages(model, request, directory)
    except Exception as error:  # noqa: BLE001 - export and Inductor raise many kinds
        raise BuildError(f"{description.name}: ahead-of-time compilation failed: "
                         f"{type(error).__name__}: {error}") from None


# --- the archive --------------------------------------------------------------------------------
def handler_section(description: ModelDescription, num_classes: int | None,
                    packages: Sequence[CompiledPackage] = ()) -> dict[str, Any]:
    """The archive YAML's `handler:` section, validated with the handler's own parser."""
    section = dict(description.handler_options)
    section["model"] = {"source": description.source, "architecture": description.architecture,
                        "num_classes": num_classes, "kwargs": dict(description.builder_kwargs)}
    section["labels_file"] = "labels.json"
    if packages:
        section["compiled_packages"] = [{"file": package.file, "target": package.target.to_dict()}
                                        for package in packages]
    try:
        SETTINGS_PARSERS[description.task](section)
    except SettingsError as error:
        raise BuildError(f"{description.name}: {error}") from None
    return section


def stage_files(description: ModelDescription, staging: Path) -> Path:
    """Write weights, labels, YAML and the handlers package into `staging`; return the weights."""
    request = compile_request(description)  # checked before any weights are made
    labels = resolve_labels(description.labels)
    num_classes = description.num_classes
    if description.source in ("timm", "torchvision"):
        num_classes = num_classes or len(labels)
        if num_classes != len(labels):
            raise BuildError(f"{description.name}: num_classes={num_classes} but "
                             f"{len(labels)} labels")
    check_architecture(description)
    weights = staging / SERIALIZED_NAMES[description.source]
    if description.source in ("timm", "torchvision"):
        write_state_dict(description, num_classes or len(labels), weights)
    else:
        copy_program(description, weights)
    extra = staging / "extra"
    shutil.copytree(HANDLER_PACKAGE, extra / "handlers",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (extra / "labels.json").write_text(json.dumps(labels), encoding="utf-8")
    packages = compiled_packages(description, request, num_classes, weights, extra / "compiled")
    model_yaml = {**frontend_settings(description.serving),
                  "handler": handler_section(description, num_classes, packages)}
    (staging / "model-config.yaml").write_text(yaml.safe_dump(model_yaml), encoding="utf-8")
    return weights


def frontend_settings(serving: ServingSettings) -> dict[str, Any]:
    """Top-level keys of the archive's YAML that TorchServe's frontend reads. It takes the
    timeouts from the archive whenever the archive has a YAML (120 s when the YAML omits them),
    whatever config.properties says; workers and batch settings stay with the register call and
    `models=`, which scale and rollouts change."""
    return {"startupTimeout": serving.startup_timeout_s, "responseTimeout": serving.response_timeout_s}


def run_archiver(description: ModelDescription, staging: Path, weights: Path, store: Path,
                 handler: Path | None = None) -> Path:
    """Run the real torch-model-archiver; return the archive's path in the model store.
    `handler`: an entry module of one's own instead of the task's (it must be inside
    `staging/extra`, so that it lands in the archive)."""
    archiver = Path(sys.executable).with_name("torch-model-archiver")
    handler = handler or staging / "extra" / "handlers" / ENTRY_MODULES[description.task]
    command = [
        str(archiver), "--model-name", description.name, "--version", description.version,
        "--serialized-file", str(weights),
        "--handler", str(handler),
        "--extra-files", str(staging / "extra"),
        "--config-file", str(staging / "model-config.yaml"),
        "--export-path", str(staging), "--force",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"torch-model-archiver failed for {description.name}:\n"
                         f"{result.stdout}{result.stderr}")
    store.mkdir(parents=True, exist_ok=True)
    target = store / description.archive_name
    shutil.move(str(staging / f"{description.name}.mar"), target)
    return target


def build_archive(description: ModelDescription, store: Path) -> Path:
    """Build one archive into `store` (replacing an older build of the same name and version)."""
    with tempfile.TemporaryDirectory(prefix=f"build-{description.name}-") as tmp:
        staging = Path(tmp)
        weights = stage_files(description, staging)
        return run_archiver(description, staging, weights, store)


# --- config.properties ----------------------------------------------------------------------------
def models_entry(descriptions: Sequence[ModelDescription]) -> dict[str, Any]:
    """The `models=` JSON TorchServe reads at start: batch and worker settings per model version."""
    entry: dict[str, Any] = {}
    for description in descriptions:
        serving = description.serving
        entry.setdefault(description.name, {})[description.version] = {
            "defaultVersion": True,
            "marName": description.archive_name,
            "minWorkers": serving.min_workers,
            "maxWorkers": serving.max_workers,
            "batchSize": serving.batch_size,
            "maxBatchDelay": serving.max_batch_delay_ms,
            "responseTimeout": serving.response_timeout_s,
        }
    return entry


def render_models_block(descriptions: Sequence[ModelDescription]) -> str:
    lines = json.dumps(models_entry(descriptions), indent=2).splitlines()
    names = ",".join(description.archive_name for description in descriptions)
    return f"load_models={names}\nmodels=" + "\\\n".join(lines) + "\n"


def write_models_block(config_path: Path, descriptions: Sequence[ModelDescription]) -> None:
    """Replace the `load_models=` and `models=` entries (which must come last) of config_path."""
    text = config_path.read_text(encoding="utf-8")
    start = text.find("\nload_models=")
    if start < 0:
        raise BuildError(f"{config_path} has no 'load_models=' line to replace")
    config_path.write_text(text[: start + 1] + render_models_block(descriptions), encoding="utf-8")


def config_in_sync(config_path: Path, descriptions: Sequence[ModelDescription]) -> bool:
    return models_property(config_path) == models_entry(descriptions)


# --- command line ---------------------------------------------------------------------------------
def description_from_flags(args: argparse.Namespace) -> ModelDescription:
    options: dict[str, Any] = {}
    if args.top_k:
        options["top_k"] = args.top_k
    if args.task == "detection":
        options["detection"] = {"output": args.detection_output}
        if args.input_size:
            options["detection"]["input_size"] = args.input_size
    labels = args.labels or ("coco" if args.task == "detection" else "imagenet")
    return parse_description({
        "name": args.name, "version": args.version, "task": args.task, "labels": labels,
        "model": {"source": args.source, "architecture": args.architecture,
                  "weights": args.weights, "num_classes": args.num_classes, "kwargs": args.kwargs},
        "handler": options,
    })


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=DEFAULT_DESCRIPTIONS,
                        help="model description YAML (default: config/models.yaml)")
    parser.add_argument("--only", nargs="*", default=None, help="build only these model names")
    parser.add_argument("--model-store", type=Path, default=DEFAULT_MODEL_STORE)
    parser.add_argument("--write-config", type=Path, nargs="*",
                        help="rewrite load_models=/models= of these configs (default: config/"
                             "config.properties and config/config.production.properties)")
    parser.add_argument("--check-config", type=Path, nargs="*",
                        help="exit 1 when these configs (default: both) disagree with the descriptions")
    single = parser.add_argument_group("one model from flags (instead of --models)")
    single.add_argument("--name")
    single.add_argument("--version", default="1.0")
    single.add_argument("--task", default="classification", choices=sorted(ENTRY_MODULES))
    single.add_argument("--source", choices=sorted(SERIALIZED_NAMES), default="torchvision")
    single.add_argument("--architecture", help="timm or torchvision model name, e.g. resnet50")
    single.add_argument("--weights", help="state-dict file, or TorchScript / torch.export file")
    single.add_argument("--labels", help="imagenet, coco, or a labels file "
                        "(default: imagenet for classification, coco for detection)")
    single.add_argument("--num-classes", type=int)
    single.add_argument("--top-k", type=int, help="classification: classes returned")
    single.add_argument("--detection-output", choices=("torchvision", "yolo"), default="torchvision",
                        help="detection: a torchvision detector, or a YOLO-style [B, 4+C, N] model")
    single.add_argument("--input-size", type=int, help="detection (yolo): square input size")
    single.add_argument("--kwargs", type=json.loads, default={},
                        help='JSON keyword arguments for the architecture builder, e.g. '
                             '\'{"box_score_thresh": 0.01}\'')
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.name:
            if not args.weights:
                raise BuildError("--weights is required with --name")
            descriptions = [description_from_flags(args)]
        else:
            descriptions = load_descriptions(args.models)
        if args.check_config is not None:
            results = {path: config_in_sync(path, descriptions)
                       for path in args.check_config or DEFAULT_CONFIGS}
            for path, in_sync in results.items():
                print(f"{path}: {'in sync' if in_sync else 'OUT OF SYNC'} with {args.models}")
            return 0 if all(results.values()) else 1
        chosen = [d for d in descriptions if args.only is None or d.name in args.only]
        if args.only and len(chosen) != len(set(args.only)):
            raise BuildError(f"--only names not in {args.models}: "
                             f"{sorted(set(args.only) - {d.name for d in chosen})}")
        for description in chosen:
            print(f"built {build_archive(description, args.model_store)}", flush=True)
        if args.write_config is not None:
            for path in args.write_config or DEFAULT_CONFIGS:
                write_models_block(path, descriptions)
                print(f"wrote load_models/models of {path}")
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
