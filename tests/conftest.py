"""Session-wide fixtures: archives are built once, with the real torch-model-archiver.

Tiers: tests that use the real archives (`model_store`, `classifier`: about a minute to build)
are marked `slow` here, as are modules marked `slow` themselves; server tests are marked
`server`. `pytest -m "not slow and not server"` is the fast tier: pure code and tiny models.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from handlers.image_classifier import ImageClassifierHandler
from tests.archives import TEST_REFERENCE_REQUESTS, load_classifier, load_classifier_dir, stage_model_dir
from torchserve_vision import paths
from torchserve_vision.archives.build import build_archive
from torchserve_vision.model_descriptions import load_descriptions, parse_description

HEAVY_FIXTURES = {"model_store", "classifier"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true",
                     help="run the tests marked gpu (a CUDA device is needed; without --gpu they "
                          "are deselected, as on the CPU machines CI runs on)")
    parser.addoption("--gpu-device", default="cuda:0",
                     help="the device the gpu tests hold to the CPU's answers (default cuda:0; "
                          "'cpu' rehearses them on a CPU machine)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of the real archives slow; deselect the gpu tests unless --gpu is given
    (deselected, not skipped: a GPU run asked with --gpu fails where no GPU answers)."""
    for item in items:
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--gpu"):
        return
    deselected = [item for item in items if item.get_closest_marker("gpu")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def build_described(name: str, store: Path) -> Path:
    """Build the archive config/models.yaml describes under `name` (in a process of its own)."""
    description = next(d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == name)
    return build_archive(description, store, reference_requests=TEST_REFERENCE_REQUESTS)


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model of config/models.yaml as described, built into a fresh model store: the
    classifiers with their ahead-of-time compiled models (about a minute each; their workers
    then start in seconds), so that every runner is checked on the CPU the tests run on. Two
    processes build the single-model archives side by side (measured on 2 cores: 172 s against
    201 s one after another: export and lowering are single-threaded), then the pipelines,
    which copy their stages, are built."""
    store = tmp_path_factory.mktemp("model_store")
    descriptions = load_descriptions(paths.MODEL_DESCRIPTIONS)
    singles = [d.name for d in descriptions if not d.is_pipeline]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(build_described, singles, [store] * len(singles)))
    for description in descriptions:
        if description.is_pipeline:
            build_archive(description, store)
    return store


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
