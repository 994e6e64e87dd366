"""Session-wide fixtures: archives are built once, with the real torch-model-archiver."""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.image_classifier import ImageClassifierHandler
from scripts.build_archives import DEFAULT_DESCRIPTIONS, build_archive, load_descriptions
from tests.archives import load_classifier


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model of config/models.yaml as described, built into a fresh model store (the
    classifier with its ahead-of-time compiled packages: the build takes about a minute, and
    its workers then start in seconds)."""
    store = tmp_path_factory.mktemp("model_store")
    for description in load_descriptions(DEFAULT_DESCRIPTIONS):
        build_archive(description, store)
    return store


@pytest.fixture(scope="session")
def classifier(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> ImageClassifierHandler:
    """The default classifier archive, loaded in-process (real weights, CPU, compiled package)."""
    return load_classifier(model_store / "efficientnet_lite0-1.0.mar",
                           tmp_path_factory.mktemp("extracted"))
