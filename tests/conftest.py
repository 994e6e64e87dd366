"""Session-wide fixtures: archives are built once, with the real torch-model-archiver.

Tiers: tests that use the real archives (`model_store`, `classifier`: about a minute to build)
are marked `slow` here, as are modules marked `slow` themselves; server tests are marked
`server`. `pytest -m "not slow and not server"` is the fast tier: pure code and tiny models.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.image_classifier import ImageClassifierHandler
from tests.archives import load_classifier, load_classifier_dir, stage_model_dir
from torchserve_vision import paths
from torchserve_vision.archives.build import build_archive
from torchserve_vision.model_descriptions import load_descriptions, parse_description

HEAVY_FIXTURES = {"model_store", "classifier"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model of config/models.yaml as described, built in order into a fresh model store
    (pipelines after their stages): the classifiers with their ahead-of-time compiled packages
    (about a minute each to build; their workers then start in seconds), so that every package
    is checked on the CPU the tests run on."""
    store = tmp_path_factory.mktemp("model_store")
    for description in load_descriptions(paths.MODEL_DESCRIPTIONS):
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
