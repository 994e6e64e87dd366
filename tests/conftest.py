"""Session-wide fixtures: archives are built once, with the real torch-model-archiver.

Tiers: tests that use the real archives (`model_store`, `classifier`: about a minute to build)
are marked `slow` here; tests that build archives of their own, export a network or compile the
frontend agent are marked `slow` where they are; server tests are marked `server`.
`pytest tests/unit -m "not slow"` is the fast tier: pure code and tiny models.
"""

from __future__ import annotations

import fcntl
import gc
import multiprocessing
import os
import shutil
import signal
from collections.abc import Generator, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from PIL import Image

from handlers.model.openvino_package import block_openvino_telemetry
from torchserve_vision import paths

# No test process sends OpenVINO's usage telemetry, whatever a test imports first (the product's
# own imports go through handlers/model/openvino_package.py; tests/unit/test_openvino_package.py
# checks them in a process of their own).
block_openvino_telemetry()

# torch and the handlers are imported where a fixture needs them, not here: pytest-xdist's
# controlling process loads this file too and runs no test (about 9 s of a core saved per run).
if TYPE_CHECKING:
    from handlers.image_classifier import ImageClassifierHandler
    from torchserve_vision.model_descriptions import ModelDescription

pytest_plugins = ["tests.cpu_by_unit"]      # `--cpu-by-unit FILE`: the CPU of each unit
HEAVY_FIXTURES = {"model_store", "classifier", "ultralytics_exports"}
PILLOW_OPEN = Image.open   # before any test imports Ultralytics (pillow_opens_as_pillow)


def pytest_configure(config: pytest.Config) -> None:
    """Python's collector of reference cycles is off until collection ends (`pytest_collection`).
    In a pytest-xdist worker, torch computes on the cores' share of that worker (scripts/test.sh
    runs as many workers as a 2-core machine has cores: one thread each). Each worker's torch
    otherwise takes every core, and two workers spinning two OpenMP threads each on two cores
    waste what they spin (the detector equivalences took 6.5 s alone and up to 38 s beside the
    store build). A test that wants more threads sets them; servers' workers set their own.
    Each pytest-xdist worker, and what it starts, draws the ports of its servers from a share of
    the range of its own (torchserve_config.PORT_SHARE_VARIABLE), so that two workers never pick
    the same port for servers starting side by side."""
    gc.disable()
    from tests.cpu_by_unit import UNIT_OF  # imported once pytest_plugins registered it
    from torchserve_vision.torchserve_config import PORT_SHARE_VARIABLE

    config.stash[UNIT_OF] = schedule_unit
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
        os.environ[PORT_SHARE_VARIABLE] = f"{worker.removeprefix('gw')}/{workers}"


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Generator[None, object, object]:
    """Collection imports every test module, and with them torch, timm, OpenVINO, Hypothesis and
    the rest: over half a million objects, which each full pass of Python's cycle collector walks
    again (about 6 s of a core per process on the 2-core Zen 4 EPYC: about half of collecting the
    whole suite, docs/testing.md). The collector is off while they load (from `pytest_configure`,
    which imports torch in a pytest-xdist worker), runs once at the end, and what is left is
    frozen (`gc.freeze`: kept out of every later pass, as it lives until the process ends) before
    the tests run with the collector on."""
    try:
        return (yield)
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true",
                     help="run the tests marked gpu (a CUDA device is needed; without --gpu they "
                          "are deselected, as on the CPU machines CI runs on)")
    parser.addoption("--gpu-device", default="cuda:0",
                     help="the device the gpu tests hold to the CPU's answers (default cuda:0; "
                          "'cpu' rehearses them on a CPU machine)")


# The unit of the schedule is a module (its tests and its servers stay in one process), except
# that the modules using the session's shared server (tests/server/conftest.py's `server`) are one
# unit: the process that runs them starts that server once a run, where each process started its
# own (about 9 s of a core, and 7 s of that process's time, each).
SHARED_SERVER_UNIT = "tests/server (the session's shared server)"
SHARED_SERVER_MODULES = frozenset({
    "tests/server/test_bad_input.py", "tests/server/test_canary.py",
    "tests/server/test_classification_server.py", "tests/server/test_detection_server.py",
    "tests/server/test_open_inference_protocol.py", "tests/server/test_pipelines.py",
    "tests/server/test_predict_command.py",
    "tests/server/test_readme_examples.py", "tests/server/test_response_cache.py",
    "tests/server/test_several_images.py", "tests/server/test_startup.py",
    "tests/server/test_torchserve_grpc.py", "tests/server/test_triton_client.py",
    "tests/server/test_ultralytics_served.py"})

# Units that take minutes (`--durations`: rollouts and canaries wait on worker starts and
# drains): scheduled first, so that no long unit starts last while the other process is idle.
# The detector architectures need no model store: the second process computes them while the
# first builds the store (which it needs first, for the rollouts).
# The autoscaling metrics wait a minute and more for Prometheus's rate window, computing little:
# next in line after the detector architectures (one run each way on the AMX Xeon: 547 s of
# pytest in this order, 586 s after the shared server's unit; runs differ by about 20 s, so not
# settled: docs/testing.md).
LONGEST_UNITS = ("tests/server/test_rollouts.py", "tests/unit/test_object_detector.py",
                 "tests/server/test_autoscaling_metrics.py", "tests/server/test_rolling_update.py",
                 SHARED_SERVER_UNIT, "tests/server/test_serving_lab_smoke.py",
                 "tests/server/test_deployment_image.py")


def schedule_unit(nodeid: str) -> str:
    """The unit of the schedule a test belongs to: its module's path, or SHARED_SERVER_UNIT."""
    module = nodeid.split("::")[0]
    return SHARED_SERVER_UNIT if module in SHARED_SERVER_MODULES else module


def uses_shared_server(item: pytest.Item) -> bool:
    """Whether `item` uses the session's shared server (not a module's own fixture of that name)."""
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None or "server" not in getattr(item, "fixturenames", ()):
        return False
    found = definitions.name2fixturedefs.get("server")
    return bool(found) and found[-1].scope == "session"


def unit_rank(unit: str, markers: set[str]) -> tuple[int, int]:
    """Where a unit's tests run in the schedule: the longest first, then those that start
    servers, then the other slow ones, the quick ones last (they fill the end evenly)."""
    if unit in LONGEST_UNITS:
        return 0, LONGEST_UNITS.index(unit)
    return (1 if "server" in markers else 2 if "slow" in markers else 3), 0


def in_schedule_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with each unit's tests together, units in `unit_rank` order (stable).
    pytest-xdist hands the units out in this order (--no-loadscope-reorder)."""
    markers: dict[str, set[str]] = {}
    for item in items:
        unit = schedule_unit(item.nodeid)
        markers.setdefault(unit, set()).update(mark.name for mark in item.iter_markers())
    first_seen = {name: index for index, name in enumerate(markers)}

    def rank(item: pytest.Item) -> tuple[tuple[int, int], int]:
        unit = schedule_unit(item.nodeid)
        return unit_rank(unit, markers[unit]), first_seen[unit]

    return sorted(items, key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """With `--dist loadfile` (scripts/test.sh), hand out `schedule_unit`s instead of modules."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return schedule_unit(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of the real archives slow; put the units in schedule order; deselect the
    gpu tests unless --gpu is given (deselected, not skipped: a GPU run asked with --gpu fails
    where no GPU answers). A module that uses the shared server and is not in
    SHARED_SERVER_MODULES is an error: its process would start a server of its own."""
    unlisted = sorted({item.nodeid.split("::")[0] for item in items if uses_shared_server(item)}
                      - SHARED_SERVER_MODULES)
    if unlisted:
        raise pytest.UsageError(f"{', '.join(unlisted)} use the session's shared server: add them "
                                "to SHARED_SERVER_MODULES in tests/conftest.py")
    for item in items:
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items[:] = in_schedule_order(items)
    if config.getoption("--gpu"):
        return
    deselected = [item for item in items if item.get_closest_marker("gpu")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


# The session's Lite1 and Lite2 archives are built without their `compile:` sections: the
# packages and engine models they would hold come from the same code as Lite0's, which is built and
# served in full, and their AOTInductor packages alone take about 150 s of a core each to compile.
# Lite2 is served as the cascade's second stage (eagerly, then), both are loaded in-process for
# their answers, and the tests that need another model's compiled files (a worker must refuse
# them) get a small network's (build_foreign_packages), built in a tenth of the time.
SESSION_EAGER = frozenset({"efficientnet_lite1", "efficientnet_lite2"})


def session_description(name: str) -> ModelDescription:
    """`name`'s description in config/models.yaml, as the session's model store builds it."""
    from torchserve_vision.model_descriptions import load_descriptions

    description = next(d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == name)
    if name not in SESSION_EAGER:
        return description
    return replace(description, handler_options={key: value for key, value in
                                                 description.handler_options.items() if key != "compile"})


def build_described(name: str, store: Path) -> Path:
    """Build the archive of `name` into `store` (in a process of its own, one of two side by side:
    torch on one thread each)."""
    import torch

    from tests.archives import TEST_REFERENCE_REQUESTS
    from torchserve_vision.archives.build import build_archive

    torch.set_num_threads(1)

    return build_archive(session_description(name), store, reference_requests=TEST_REFERENCE_REQUESTS)


def build_foreign_packages(directory: Path) -> Path:
    """Another classifier's compiled files, named as the Lite0 archive names its own: a small
    fixed-seed network with Lite0's input (3 x 224 x 224) and 1000 classes, as an AOTInductor
    package (`model-fp32.pt2`, and the same package as `model-bf16.pt2`) and an ONNX model
    (`model.onnx`). It runs on Lite0's probe photos and answers them wrongly."""
    import torch
    from torch import nn

    from torchserve_vision.archives.compile_ahead import CompileRequest, compile_package
    from torchserve_vision.archives.engine_exports import export_onnx

    torch.set_num_threads(1)        # beside the other builds of the pool
    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv2d(3, 16, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                            nn.Flatten(), nn.Linear(16, 1000)).eval()
    shape = (3, 224, 224)
    request = CompileRequest(precision="fp32", cpu_target="avx2", max_batch_size=8,
                             input_shape_chw=shape, channels_last=True, resize_size=256)
    directory.mkdir(parents=True, exist_ok=True)
    compile_package(network.to(memory_format=torch.channels_last), request, "fp32",
                    directory / "model-fp32.pt2")
    shutil.copy(directory / "model-fp32.pt2", directory / "model-bf16.pt2")
    export_onnx(network, shape, directory / "model.onnx")
    return directory


def shared_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temporary root: shared by pytest-xdist's worker processes (each has its own
    directory under it), the session's own directory without them."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def one_fork_server_per_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The servers a test process starts hand their workers to one fork server owned by that
    process (torchserve_vision.worker_forkserver's OWNER_VARIABLE), so that no server start
    after the first imports torch again: 3-4 s of a core each, about 30 starts a run. A server
    started inside `tests.server.servers.fork_server_of_its_own` starts its own beside its
    frontend, as outside the tests, and so do pods in a PID namespace. Nothing is shared when the
    environment turns the fork server off or names an owner already."""
    from torchserve_vision.worker_forkserver import DIRECTORY_VARIABLE, OWNER_VARIABLE, SWITCH_VARIABLE

    if os.environ.get(SWITCH_VARIABLE) == "0" or OWNER_VARIABLE in os.environ:
        yield
        return
    directory = tmp_path_factory.mktemp("fork-servers")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(OWNER_VARIABLE, str(os.getpid()))
        patch.setenv(DIRECTORY_VARIABLE, str(directory))
        yield


@pytest.fixture(autouse=True)
def pillow_opens_as_pillow() -> Iterator[None]:
    """Each test ends with Pillow's own `Image.open`: importing Ultralytics (its tests do)
    replaces it, in the whole process, with one that on an image Pillow cannot identify asks
    pip for pi-heif and raises ModuleNotFoundError where it is missing, where a 400 is due."""
    yield
    Image.open = PILLOW_OPEN


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the test, whatever this process inherited (a job started
    in the background of a shell without job control inherits SIGINT ignored)."""
    from torchserve_vision.rollout import sigint_handled_by

    with sigint_handled_by(signal.default_int_handler):
        yield


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model of config/models.yaml as described (Lite1 and Lite2 without `compile:`:
    SESSION_EAGER), built into a fresh model store: Lite0 with its ahead-of-time compiled models
    (AOTInductor, OpenVINO, ONNX: over two minutes of a core; its workers then start in seconds)
    and SSDlite with its engine models, so that every runner is checked on the CPU the tests run
    on; beside it, another model's compiled files (`foreign_packages`). Two processes build the
    single-model archives side by side, the compiled ones first (export and lowering are
    single-threaded), then the pipelines, which copy their stages, side by side as well. Built
    once per run: with pytest-xdist the first worker that needs it builds it under a lock, the
    others wait for it and share it."""
    root = shared_directory(tmp_path_factory)
    store = root / "model_store"
    with open(root / "model_store.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "model_store.built").exists():
            shutil.rmtree(store, ignore_errors=True)
            store.mkdir()
            build_model_store(store, root / "foreign_packages")
            (root / "model_store.built").touch()
    return store


@pytest.fixture(scope="session")
def foreign_packages(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model's compiled files (build_foreign_packages), built with the model store."""
    return shared_directory(tmp_path_factory) / "foreign_packages"


def build_model_store(store: Path, foreign: Path) -> None:
    """The archives into `store` and build_foreign_packages into `foreign`."""
    from torchserve_vision.model_descriptions import load_descriptions

    descriptions = load_descriptions(paths.MODEL_DESCRIPTIONS)
    singles = [d.name for d in descriptions if not d.is_pipeline]
    # the compiled ones first, so that no long build starts last in the pool
    singles.sort(key=lambda name: "compile" not in session_description(name).handler_options)
    pipelines = [d.name for d in descriptions if d.is_pipeline]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        archives = pool.map(build_described, singles, [store] * len(singles))
        pool.submit(build_foreign_packages, foreign).result()
        list(archives)
        list(pool.map(build_described, pipelines, [store] * len(pipelines)))   # their stages are built


# Ultralytics exports of networks built from the package's own yaml files (tests/ultralytics_models.py):
# name -> (yaml, format, input size, export arguments). The detectors at Ultralytics' default 640;
# the other tasks, which only need to be refused, at 320.
ULTRALYTICS_EXPORTS: dict[str, tuple[str, str, int, dict[str, object]]] = {
    "yolov8n.torchscript": ("yolov8n.yaml", "torchscript", 640, {}),
    "yolov8n.onnx": ("yolov8n.yaml", "onnx", 640, {}),
    "yolo11n.torchscript": ("yolo11n.yaml", "torchscript", 640, {}),
    "yolo26n-end2end.torchscript": ("yolo26n.yaml", "torchscript", 640, {"end2end": True}),
    "yolov8n-cls.torchscript": ("yolov8n-cls.yaml", "torchscript", 224, {}),
    "yolov8n-cls.onnx": ("yolov8n-cls.yaml", "onnx", 224, {}),
    "yolov8n-seg.torchscript": ("yolov8n-seg.yaml", "torchscript", 320, {}),
    "yolov8n-pose.torchscript": ("yolov8n-pose.yaml", "torchscript", 320, {}),
    "yolov8n-obb.torchscript": ("yolov8n-obb.yaml", "torchscript", 320, {}),
}


@pytest.fixture(scope="session")
def ultralytics_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ULTRALYTICS_EXPORTS exported once per run (a few seconds each), shared by the processes
    as the model store is; or, where TSV_ULTRALYTICS_EXPORTS names a folder of them exported
    beforehand (a GPU host without the `ultralytics` package), those files."""
    from tests.ultralytics_models import exported

    prepared = os.environ.get("TSV_ULTRALYTICS_EXPORTS")
    if prepared:
        return {name: Path(prepared) / name for name in ULTRALYTICS_EXPORTS}
    root = shared_directory(tmp_path_factory) / "ultralytics"
    root.mkdir(exist_ok=True)
    paths: dict[str, Path] = {}
    with open(root / "exports.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name, (yaml_name, export_format, size, arguments) in ULTRALYTICS_EXPORTS.items():
            target = root / name
            if not target.exists():
                made = exported(yaml_name, export_format, root / f"{name}.work", size, **arguments)
                shutil.move(made, target)
            paths[name] = target
    return paths


@pytest.fixture(scope="session")
def classifier(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> ImageClassifierHandler:
    """The default classifier archive, loaded in-process (real weights, CPU, compiled package)."""
    from tests.archives import load_classifier

    return load_classifier(model_store / "efficientnet_lite0-1.0.mar",
                           tmp_path_factory.mktemp("extracted"))


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> ImageClassifierHandler:
    """A classifier handler on timm's tiny `test_efficientnet` (fixed seed 1: the five bundled
    photos get five different answers), 64 px input, eager: for handler mechanics that need no
    real weights. Staged in about a second."""
    from tests.archives import load_classifier_dir, stage_model_dir
    from torchserve_vision.model_descriptions import parse_description

    description = parse_description({
        "name": "tiny", "version": "1.0", "labels": "imagenet",
        "model": {"source": "timm", "architecture": "test_efficientnet", "weights": "fixed-seed:1"},
        "handler": {"preprocess": {"resize_size": 72, "input_size": 64}}})
    return load_classifier_dir(stage_model_dir(description, tmp_path_factory.mktemp("tiny")))
