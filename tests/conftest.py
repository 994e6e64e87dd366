"""Session-wide fixtures: archives are built once, with the real torch-model-archiver.

Tiers: tests that use the real archives (`model_store`, `classifier`: about a minute to build)
are marked `slow` here, as are modules marked `slow` themselves; server tests are marked
`server`. `pytest -m "not slow and not server"` is the fast tier: pure code and tiny models.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from handlers.image_classifier import ImageClassifierHandler
from tests.archives import TEST_REFERENCE_REQUESTS, load_classifier, load_classifier_dir, stage_model_dir
from torchserve_vision import paths
from torchserve_vision.archives.build import build_archive
from torchserve_vision.model_descriptions import ModelDescription, load_descriptions, parse_description

HEAVY_FIXTURES = {"model_store", "classifier"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true",
                     help="run the tests marked gpu (a CUDA device is needed; without --gpu they "
                          "are deselected, as on the CPU machines CI runs on)")
    parser.addoption("--gpu-device", default="cuda:0",
                     help="the device the gpu tests hold to the CPU's answers (default cuda:0; "
                          "'cpu' rehearses them on a CPU machine)")


# Modules that take minutes (`--durations`: rollouts and canaries wait on worker starts and
# drains): scheduled first, so that no long module starts last while the other process is idle.
LONGEST_MODULES = ("server/test_rollouts", "server/test_rolling_update", "server/test_canary",
                   "server/test_autoscaling_metrics", "server/test_deployment_image",
                   "server/test_serving_lab_smoke", "unit/test_object_detector")


def module_rank(module: str, markers: set[str]) -> tuple[int, int]:
    """Where a module's tests run in the schedule: the longest first, then those that start
    servers, then the other slow ones, the quick ones last (they fill the end evenly)."""
    if module in LONGEST_MODULES:
        return 0, LONGEST_MODULES.index(module)
    return (1 if "server" in markers else 2 if "slow" in markers else 3), 0


def in_schedule_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with each module's tests together, modules in `module_rank` order (stable).
    pytest-xdist's loadfile hands the modules out in this order (--no-loadscope-reorder)."""
    def module(item: pytest.Item) -> str:
        return f"{item.path.parent.name}/{item.path.stem}"

    markers: dict[str, set[str]] = {}
    for item in items:
        markers.setdefault(module(item), set()).update(mark.name for mark in item.iter_markers())
    first_seen = {name: index for index, name in enumerate(markers)}
    return sorted(items, key=lambda item: (module_rank(module(item), markers[module(item)]),
                                           first_seen[module(item)]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of the real archives slow; put the modules in schedule order; deselect the
    gpu tests unless --gpu is given (deselected, not skipped: a GPU run asked with --gpu fails
    where no GPU answers)."""
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


# The session's Lite2 archive is built without its `compile:` section: the packages and engine
# models it would hold come from the same code as Lite0's and Lite1's, which are built and served
# in full, and Lite2's AOTInductor packages alone take about 150 s of a core to compile. It is
# served as the cascade's second stage (eagerly, then) and loaded in-process for its answers.
SESSION_EAGER = frozenset({"efficientnet_lite2"})


def session_description(name: str) -> ModelDescription:
    """`name`'s description in config/models.yaml, as the session's model store builds it."""
    description = next(d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == name)
    if name not in SESSION_EAGER:
        return description
    return replace(description, handler_options={key: value for key, value in
                                                 description.handler_options.items() if key != "compile"})


def build_described(name: str, store: Path) -> Path:
    """Build the archive of `name` into `store` (in a process of its own)."""
    return build_archive(session_description(name), store, reference_requests=TEST_REFERENCE_REQUESTS)


def shared_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temporary root: shared by pytest-xdist's worker processes (each has its own
    directory under it), the session's own directory without them."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model of config/models.yaml as described (Lite2 without `compile:`: SESSION_EAGER),
    built into a fresh model store: the classifiers with their ahead-of-time compiled models
    (AOTInductor, OpenVINO, ONNX: over two minutes of a core each; their workers then start in
    seconds), so that every runner is checked on the CPU the tests run on. Two processes build
    the single-model archives side by side, the compiled ones first (export and lowering are
    single-threaded), then the pipelines, which copy their stages, are built. Built once per
    run: with pytest-xdist the first worker that needs it builds it under a lock, the others
    wait for it and share it."""
    root = shared_directory(tmp_path_factory)
    store = root / "model_store"
    with open(root / "model_store.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "model_store.built").exists():
            shutil.rmtree(store, ignore_errors=True)
            store.mkdir()
            build_model_store(store)
            (root / "model_store.built").touch()
    return store


def build_model_store(store: Path) -> None:
    descriptions = load_descriptions(paths.MODEL_DESCRIPTIONS)
    singles = [d.name for d in descriptions if not d.is_pipeline]
    # the compiled ones first, so that no long build starts last in the pool
    singles.sort(key=lambda name: "compile" not in session_description(name).handler_options)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(build_described, singles, [store] * len(singles)))
    for description in descriptions:
        if description.is_pipeline:
            build_archive(description, store)


@pytest.fixture(scope="session")
def classifier(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> ImageClassifierHandler:
    """The default classifier archive, loaded in-process (real weights, CPU, compiled package)."""
    return load_classifier(model_store / "efficientnet_lite0-1.0.mar",
                           tmp_path_factory.mktemp("extracted"))


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> ImageClassifierHandler:
    """A classifier handler on timm's tiny `test_efficientnet` (fixed seed 1: the five bundled
    photos get five different answers), 64 px input, eager: for handler mechanics that need no
    real weights. Staged in about a second."""
    description = parse_description({
        "name": "tiny", "version": "1.0", "labels": "imagenet",
        "model": {"source": "timm", "architecture": "test_efficientnet", "weights": "fixed-seed:1"},
        "handler": {"preprocess": {"resize_size": 72, "input_size": 64}}})
    return load_classifier_dir(stage_model_dir(description, tmp_path_factory.mktemp("tiny")))
