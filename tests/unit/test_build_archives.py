"""The archive builder: real torch-model-archiver runs, error messages, every model source."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
import torchvision
import yaml
from torch import nn

import handlers
from handlers.drift.drift_features import CLASSIFICATION_FEATURES, class_range
from handlers.drift.drift_profile import PROFILE_FILE, DriftProfile
from handlers.ground.limits import ImageLimits
from handlers.model.runner_order import DEFAULT_RUNNER_ORDER
from handlers.request.decode import decode_image_bytes
from handlers.task.transforms import preprocess_classification_batch
from tests.archives import (
    TEST_REFERENCE_REQUESTS,
    archive_context,
    load_classifier,
    load_classifier_dir,
    stage_model_dir,
)
from tests.images import photo_bytes
from torchserve_vision import paths
from torchserve_vision.archives.build import BuildError, build_archive, frontend_settings
from torchserve_vision.archives.drift_reference import REFERENCE_REQUESTS
from torchserve_vision.archives.fixed_seed_weights import calibrated_classifier
from torchserve_vision.cli import main as command
from torchserve_vision.model_descriptions import (
    QUEUED_FALLBACK_DELAY_MS,
    DescriptionError,
    ServingSettings,
    load_descriptions,
    parse_description,
)
from torchserve_vision.model_kinds import KINDS
from torchserve_vision.torchserve_config import config_in_sync, parse_properties, render_models_block

PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png"]
TEN_LABELS = [f"class_{i}" for i in range(10)]


class TinyNet(nn.Module):
    """A small CNN whose fixed-seed answers differ from photo to photo."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 5, stride=4), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, stride=2), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3))) * 10


def describe(name: str, source: str, weights: Path, labels: Path | str, **model: object):
    return parse_description({"name": name, "version": "1.0", "labels": str(labels),
                              "model": {"source": source, "weights": str(weights), **model},
                              "handler": {"top_k": 10}})


@pytest.fixture(scope="module")
def labels_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("labels") / "labels.txt"
    path.write_text("\n".join(TEN_LABELS))
    return path


@pytest.fixture(scope="module")
def tiny_net() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet().eval()


def photo_batch(names: list[str] = PHOTOS) -> torch.Tensor:
    """The photos preprocessed as the handler does with default (ImageNet) settings."""
    images = [decode_image_bytes(photo_bytes(name), ImageLimits()) for name in names]
    return preprocess_classification_batch(images, 256, 224, (0.485, 0.456, 0.406),
                                           (0.229, 0.224, 0.225), torch.device("cpu"))


def eager_top(model: nn.Module, image: bytes) -> list[int]:
    batch = preprocess_classification_batch([decode_image_bytes(image, ImageLimits())], 256, 224,
                                            (0.485, 0.456, 0.406), (0.229, 0.224, 0.225),
                                            torch.device("cpu"))
    with torch.inference_mode():
        return torch.softmax(model(batch), 1)[0].argsort(descending=True).tolist()


def served_top(mar: Path, work: Path) -> list[list[int]]:
    handler = load_classifier(mar, work)
    rows = [{"body": bytearray(photo_bytes(name))} for name in PHOTOS]
    answers = [json.loads(b) for b in handler.handle(rows, archive_context(handler.model_dir))]
    return [[c["index"] for c in answer] for answer in answers]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["torchscript", "export"])
def test_program_files_serve_the_same_answers_as_the_eager_model(source, tiny_net, labels_file,
                                                                 tmp_path):
    program = tmp_path / "program.pt"
    example = torch.zeros(2, 3, 224, 224)
    if source == "torchscript":
        torch.jit.save(torch.jit.trace(tiny_net, example), program)
    else:
        batch = torch.export.Dim("batch", min=1, max=64)
        torch.export.save(torch.export.export(tiny_net, (example,), dynamic_shapes=({0: batch},)),
                          program)
    mar = build_archive(describe("tiny", source, program, labels_file), tmp_path / "store")
    served = served_top(mar, tmp_path / "work")
    expected = [eager_top(tiny_net, photo_bytes(name)) for name in PHOTOS]
    assert served == expected
    assert len({tuple(order) for order in served}) == len(PHOTOS)  # answers differ per photo


@pytest.mark.slow
def test_a_torchvision_classifier_by_name_from_a_state_dict(labels_file, tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=10)
    calibrated_classifier(model, [photo_batch()])
    weights = tmp_path / "mobilenet.pth"
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, weights)  # as training scripts save
    mar = build_archive(describe("mnv3", "torchvision", weights, labels_file,
                                 architecture="mobilenet_v3_small"), tmp_path / "store")
    served = served_top(mar, tmp_path / "work")
    assert served == [eager_top(model, photo_bytes(name)) for name in PHOTOS]
    assert len({tuple(order) for order in served}) == len(PHOTOS)  # answers differ per photo
    # the drift reference profile, recorded by the archive's own handler from the project's photos
    with zipfile.ZipFile(mar) as archive:
        profile = DriftProfile.from_json(archive.read(PROFILE_FILE).decode())
    assert set(profile.shares) == set(CLASSIFICATION_FEATURES)
    assert profile.observations == dict.fromkeys(CLASSIFICATION_FEATURES, REFERENCE_REQUESTS)
    assert all(sum(shares.values()) == pytest.approx(1.0) for shares in profile.shares.values())
    reachable = {class_range(index, 10) for index in range(10)}      # 10 classes in 16 ranges
    assert {bucket for bucket, share in profile.shares["class"].items() if share} <= reachable
    assert profile.shares["format"]["JPEG"] == 1.0 and "project's photos" in profile.source


def test_missing_weights_stop_the_build(labels_file, tmp_path):
    with pytest.raises(BuildError, match="weights file not found"):
        build_archive(describe("x", "torchvision", tmp_path / "nope.pth", labels_file,
                               architecture="resnet18"), tmp_path)


def test_unknown_architecture_stops_the_build(labels_file, tmp_path):
    weights = tmp_path / "w.pth"
    torch.save({}, weights)
    with pytest.raises(BuildError, match="unknown torchvision architecture 'resnet1000'"):
        build_archive(describe("x", "torchvision", weights, labels_file, architecture="resnet1000"),
                      tmp_path)


@pytest.mark.slow
def test_weights_that_do_not_fit_stop_the_build(tmp_path):
    weights = tmp_path / "w.pth"
    torch.save(torchvision.models.get_model("resnet18", num_classes=10).state_dict(), weights)
    with pytest.raises(BuildError, match="do not fit torchvision:resnet34"):
        build_archive(describe("x", "torchvision", weights, "imagenet", architecture="resnet34"),
                      tmp_path)
    with pytest.raises(BuildError, match="do not fit torchvision:resnet18"):  # 10 classes vs 1000
        build_archive(describe("x", "torchvision", weights, "imagenet", architecture="resnet18"),
                      tmp_path)
    assert not list(tmp_path.glob("*.mar"))


def test_a_file_that_is_not_torchscript_stops_the_build(labels_file, tmp_path):
    bogus = tmp_path / "model.ts"
    bogus.write_bytes(b"not a program")
    with pytest.raises(BuildError, match="not a loadable torchscript file"):
        build_archive(describe("x", "torchscript", bogus, labels_file), tmp_path)


def test_bad_handler_options_stop_the_build(tmp_path):
    description = parse_description({"name": "x", "labels": "imagenet", "handler": {"top_k": -1},
                                     "model": {"source": "timm", "architecture": "efficientnet_lite0",
                                               "weights": "package:efficientnet_lite0"}})
    with pytest.raises(BuildError, match="top_k"):
        build_archive(description, tmp_path)


def test_the_command_line_reports_errors_without_a_traceback(tmp_path, capsys):
    code = command(["build", "--name", "x", "--source", "torchvision", "--architecture", "resnet18",
                    "--weights", str(tmp_path / "missing.pth"), "--model-store", str(tmp_path)])
    assert code == 1
    assert "error: weights file not found" in capsys.readouterr().err


def archive_digest(mar: Path) -> dict[str, str]:
    with zipfile.ZipFile(mar) as archive:
        return {name: hashlib.sha256(archive.read(name)).hexdigest()
                for name in archive.namelist() if name != "MAR-INF/MANIFEST.json"}


def test_rebuilding_is_idempotent(model_store, tmp_path):
    """Byte for byte, apart from the compiled packages (Inductor's output is not reproducible
    byte for byte, and each package is checked against the eager model when a worker loads it)."""
    described = load_descriptions(paths.MODEL_DESCRIPTIONS)[0]
    eager = dataclasses.replace(described, handler_options={**described.handler_options, "compile": False})
    rebuilt = archive_digest(build_archive(eager, tmp_path, reference_requests=TEST_REFERENCE_REQUESTS))
    again = build_archive(eager, tmp_path, reference_requests=TEST_REFERENCE_REQUESTS)
    assert archive_digest(again) == rebuilt
    served = archive_digest(model_store / described.archive_name)
    assert {name: digest for name, digest in served.items()
            if not name.startswith("compiled/") and name != "model-config.yaml"} == {
        name: digest for name, digest in rebuilt.items() if name != "model-config.yaml"}


def test_the_default_classifier_archive_holds_compiled_packages_and_the_timeouts(model_store):
    with zipfile.ZipFile(model_store / "efficientnet_lite0-1.0.mar") as archive:
        model_yaml = yaml.safe_load(archive.read("model-config.yaml"))
        names = set(archive.namelist())
    serving = load_descriptions(paths.MODEL_DESCRIPTIONS)[0].serving
    assert model_yaml["startupTimeout"] == serving.startup_timeout_s
    assert model_yaml["responseTimeout"] == serving.response_timeout_s
    packages = model_yaml["handler"]["compiled_packages"]
    assert [package["target"]["precision"] for package in packages] == ["fp32", "bf16"]
    for package in packages:
        assert package["file"] in names
        assert package["target"]["cpu_capability"] == "AVX2"   # the portable target, not this CPU's
        assert package["target"]["max_batch_size"] == serving.batch_size
        assert package["target"]["torch_version"] == str(torch.__version__)
    engine_models = {model["engine"]: model["file"] for model in model_yaml["handler"]["engine_models"]}
    assert engine_models == {"openvino": "compiled/model-openvino.xml", "onnxruntime": "compiled/model.onnx"}
    assert {*engine_models.values(), "compiled/model-openvino.bin", "compiled/probe-photos.pt"} <= names
    # No int8 model (compile.int8 is not set): the order leaves its runner out.
    assert "int8_gate" not in model_yaml["handler"]
    assert model_yaml["handler"]["runner_order"] == {
        kind: [name for name in order if name != "openvino-int8"]
        for kind, order in DEFAULT_RUNNER_ORDER.items()}


@pytest.mark.slow
def test_an_archive_built_for_some_engines_holds_only_their_models_and_orders_only_them(tmp_path):
    """`compile: {engines: [onnxruntime]}` on timm's tiny test network: only the ONNX model is
    built, the recorded order names only its runner, and the worker serves it."""
    description = parse_description({
        "name": "tiny", "version": "1.0", "labels": "imagenet",
        "model": {"source": "timm", "architecture": "test_efficientnet", "weights": "fixed-seed:1"},
        "handler": {"preprocess": {"resize_size": 72, "input_size": 64},
                    "compile": {"engines": ["onnxruntime"]}}})
    model_dir = stage_model_dir(description, tmp_path)
    handler_yaml = yaml.safe_load((model_dir / "model-config.yaml").read_text())["handler"]
    assert "compiled_packages" not in handler_yaml
    assert handler_yaml["engine_models"] == [
        {"engine": "onnxruntime", "file": "compiled/model.onnx", "weights": "fp32"}]
    assert set(handler_yaml["runner_order"]["avx2"]) == {"onnxruntime-fp32"}
    compiled = sorted(path.name for path in (model_dir / "compiled").iterdir())
    assert compiled == ["model.onnx", "probe-photos.pt"]
    handler = load_classifier_dir(model_dir)
    assert handler.runner == "onnxruntime-fp32"


@pytest.mark.slow
def test_an_archive_for_gpu_workers_holds_no_cpu_packages_and_still_answers(tmp_path):
    """`build --target gpu` (the GPU image): the described Lite0 with its `compile:` section gets
    no ahead-of-time CPU packages, and its handler serves the eager network."""
    described = load_descriptions(paths.MODEL_DESCRIPTIONS)[0]
    assert described.handler_options.get("compile")
    assert command(["build", "--only", described.name, "--target", "gpu",
                    "--model-store", str(tmp_path / "store")]) == 0
    mar = tmp_path / "store" / described.archive_name
    with zipfile.ZipFile(mar) as archive:
        model_yaml = yaml.safe_load(archive.read("model-config.yaml"))
        names = archive.namelist()
    assert "compiled_packages" not in model_yaml["handler"]
    assert not [name for name in names if name.startswith("compiled/")]
    handler = load_classifier(mar, tmp_path / "work", batch_size=2)
    assert handler.runner == "eager"
    (answer,) = handler.handle([{"body": bytearray(photo_bytes("chelsea.png"))}],
                               archive_context(handler.model_dir))
    assert json.loads(answer)[0]["label"]


def test_compile_is_refused_where_it_cannot_apply(tmp_path):
    two_stage = parse_description({"name": "d", "task": "detection", "labels": "coco",
                                   "model": {"source": "torchvision", "weights": "fixed-seed:0",
                                             "architecture": "fasterrcnn_mobilenet_v3_large_320_fpn"},
                                   "handler": {"compile": True}})
    with pytest.raises(BuildError, match="not a torchvision SSD-family detector"):
        build_archive(two_stage, tmp_path)
    packaged = parse_description({"name": "d", "task": "detection", "labels": "coco",
                                  "model": {"source": "torchvision", "weights": "fixed-seed:0",
                                            "architecture": "ssdlite320_mobilenet_v3_large"},
                                  "handler": {"compile": {"engines": ["aoti"]}}})
    with pytest.raises(BuildError, match="cannot apply"):
        build_archive(packaged, tmp_path)
    old_style = parse_description({"name": "c", "labels": "imagenet",
                                   "model": {"source": "timm", "weights": "package:efficientnet_lite0",
                                             "architecture": "efficientnet_lite0"},
                                   "handler": {"compile": "max-autotune"}})
    with pytest.raises(BuildError, match=r"never runs torch\.compile"):
        build_archive(old_style, tmp_path)


def test_the_default_archive_holds_the_handlers_package_and_real_weights(model_store):
    with zipfile.ZipFile(model_store / "efficientnet_lite0-1.0.mar") as archive:
        names = set(archive.namelist())
        manifest = json.loads(archive.read("MAR-INF/MANIFEST.json"))
        stored = {item.filename for item in archive.infolist() if item.compress_type == zipfile.ZIP_STORED}
    assert {"handlers/serving.py", "handlers/request/decode.py", "labels.json", "model.pt"} <= names
    # weights and compiled models stored, not deflated: every registration inflates the archive
    assert {"model.pt", "compiled/model-fp32.pt2", "compiled/model.onnx",
            "compiled/model-openvino.bin"} <= stored
    assert manifest["model"]["handler"] == "image_classifier.py"
    assert manifest["model"]["modelVersion"] == "1.0"


def test_config_properties_agrees_with_the_model_descriptions():
    descriptions = load_descriptions(paths.MODEL_DESCRIPTIONS)
    assert all(config_in_sync(path, descriptions) for path in paths.SERVER_CONFIGS)
    rendered = parse_properties(render_models_block(descriptions))
    assert rendered["load_models"].split(",") == [d.archive_name for d in descriptions if d.start]
    assert {"efficientnet_lite0", "ssd_mobilenet_v2"} <= {d.name for d in descriptions if d.start}
    assert "efficientnet_cascade" not in json.loads(rendered["models"])  # built, registered on demand
    entry = json.loads(rendered["models"])["efficientnet_lite0"]["1.0"]
    assert entry["batchSize"] == descriptions[0].serving.batch_size
    assert entry["maxBatchDelay"] == descriptions[0].serving.max_batch_delay_ms


def test_a_version_built_from_flags_keeps_the_described_settings_unless_fresh(tmp_path, capsys):
    """`build --name efficientnet_lite0 ...` builds another network under a described name: its
    normalisation, precision, channels_last, threads, compile and serving settings stay those of
    config/models.yaml; flags that set an option win; --fresh starts from defaults."""
    from torchserve_vision.cli import command_parser
    from torchserve_vision.cli.build import chosen_descriptions

    weights = str(tmp_path / "lite2.pth")
    flags = ["build", "--name", "efficientnet_lite0", "--version", "2.0", "--source", "timm",
             "--architecture", "efficientnet_lite2", "--weights", weights, "--top-k", "3"]
    described = next(d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == "efficientnet_lite0")
    [kept] = chosen_descriptions(command_parser().parse_args(flags))
    assert "settings of efficientnet_lite0 in" in capsys.readouterr().out
    assert (kept.architecture, kept.weights, kept.version) == ("efficientnet_lite2", weights, "2.0")
    for option in ("preprocess", "precision", "channels_last", "torch_threads", "compile", "limits"):
        assert kept.handler_options[option] == described.handler_options[option], option
    assert kept.handler_options["top_k"] == 3
    assert kept.serving == described.serving
    [fresh] = chosen_descriptions(command_parser().parse_args([*flags, "--fresh"]))
    assert "preprocess" not in fresh.handler_options and fresh.serving != described.serving
    [resized] = chosen_descriptions(command_parser().parse_args(
        [*flags, "--input-size", "260", "--resize-size", "297"]))
    assert resized.handler_options["preprocess"] == {**described.handler_options["preprocess"],
                                                     "input_size": 260, "resize_size": 297}


@pytest.mark.parametrize("entry_module", sorted(kind.entry_module for kind in KINDS.values()))
def test_every_entry_module_defines_exactly_one_class(entry_module):
    """TorchServe loads the one class an entry module defines; a second one (a dataclass, too)
    fails every worker at load ("Expected only one class in custom service code")."""
    import ast

    tree = ast.parse((Path(handlers.__file__).parent / entry_module).read_text())
    assert len([node for node in tree.body if isinstance(node, ast.ClassDef)]) == 1


def test_a_cascade_version_from_flags_takes_the_described_cascades_settings(capsys):
    """`build --name efficientnet_lite0 --version 3.0 --task cascade --stages ...`: a cascade as a
    new version of the classifier's endpoint, with the escalation rule, threads and serving
    settings of the cascade config/models.yaml describes."""
    from torchserve_vision.cli import command_parser
    from torchserve_vision.cli.build import chosen_descriptions

    flags = ["build", "--name", "efficientnet_lite0", "--version", "3.0", "--task", "cascade",
             "--stages", "first=efficientnet_lite0-1.0", "second=efficientnet_lite0-2.0.mar"]
    [cascade] = chosen_descriptions(command_parser().parse_args(flags))
    described = next(d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.task == "cascade")
    assert f"settings of {described.name}" in capsys.readouterr().out
    assert (cascade.name, cascade.version, cascade.archive_name) == (
        "efficientnet_lite0", "3.0", "efficientnet_lite0-3.0.mar")
    assert cascade.stages == {"first": "efficientnet_lite0-1.0", "second": "efficientnet_lite0-2.0"}
    assert cascade.handler_options == described.handler_options
    assert cascade.serving == described.serving
    with pytest.raises(DescriptionError, match="exactly first, second"):
        chosen_descriptions(command_parser().parse_args([*flags[:-2], "first=a-1.0"]))


def test_continuous_batching_is_refused_for_archives_with_the_reason():
    """TorchServe 0.12's asynchronous frontend breaks unregistering (docs/benchmarks.md): the
    policy is measured in the lab (`lab policies`), never built into an archive."""
    description = parse_description({"name": "m", "labels": "imagenet",
                                     "model": {"source": "timm", "architecture": "test_efficientnet",
                                               "weights": "fixed-seed:0"},
                                     "handler": {"continuous_batching": True}})
    with pytest.raises(BuildError, match="Deque full"):
        frontend_settings(description)
    assert "asyncCommunication" not in frontend_settings(
        dataclasses.replace(description, handler_options={}))


def test_queued_batching_is_switched_on_in_the_archive_and_read_back_from_describe():
    """The frontend picks its batch aggregator from the archive's YAML (`continuousBatching`),
    which the frontend agent answers with queued batching; describe reports it."""
    raw = {"name": "m", "labels": "imagenet",
           "model": {"source": "timm", "architecture": "test_efficientnet", "weights": "fixed-seed:0"}}
    queued = parse_description({**raw, "serving": {"batching": "queued"}})
    assert frontend_settings(queued)["continuousBatching"] is True
    assert frontend_settings(parse_description(raw))["continuousBatching"] is True  # the default
    delayed = parse_description({**raw, "serving": {"batching": "delayed"}})
    assert "continuousBatching" not in frontend_settings(delayed)
    with pytest.raises(DescriptionError, match="use delayed or queued"):
        parse_description({**raw, "serving": {"batching": "eventually"}})
    described = {"batchSize": 8, "maxBatchDelay": 100, "minWorkers": 2, "maxWorkers": 2,
                 "responseTimeout": 60, "startupTimeout": 120}
    queued_version = ServingSettings.of_version({**described, "continuousBatching": True})
    # Queued: whatever delay TorchServe reports reads as the fallback it is given (1 ms).
    assert queued_version.batching == "queued"
    assert queued_version.max_batch_delay_ms == QUEUED_FALLBACK_DELAY_MS
    delayed_version = ServingSettings.of_version({**described, "continuousBatching": False})
    assert (delayed_version.batching, delayed_version.max_batch_delay_ms) == ("delayed", 100)


def test_a_deadline_goes_into_the_archive_with_queued_batching_only_and_is_read_back():
    """`serving.deadline_ms` becomes TorchServe's clientTimeoutInMills, which only the frontend
    agent's queued batching answers; delayed batching would drop expired requests unanswered."""
    raw = {"name": "m", "labels": "imagenet",
           "model": {"source": "timm", "architecture": "test_efficientnet", "weights": "fixed-seed:0"}}
    assert frontend_settings(parse_description(raw))["clientTimeoutInMills"] == 0       # none
    with_deadline = parse_description({**raw, "serving": {"deadline_ms": 800}})
    assert frontend_settings(with_deadline)["clientTimeoutInMills"] == 800
    with pytest.raises(DescriptionError, match="needs batching: queued"):
        parse_description({**raw, "serving": {"batching": "delayed", "deadline_ms": 800}})
    for bad in (-1, 1.5, "800", True):
        with pytest.raises(DescriptionError, match="whole number of milliseconds"):
            parse_description({**raw, "serving": {"deadline_ms": bad}})
    described = {"batchSize": 8, "maxBatchDelay": 100, "minWorkers": 2, "maxWorkers": 2,
                 "responseTimeout": 60, "startupTimeout": 120, "clientTimeoutInMills": 800}
    assert ServingSettings.of_version({**described, "continuousBatching": True}).deadline_ms == 800
    # TorchServe's own batching (an archive made elsewhere): not a deadline this project answers.
    assert ServingSettings.of_version({**described, "continuousBatching": False}).deadline_ms == 0
