"""Session-wide fixtures: archives are built once, with the real torch-model-archiver."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from handlers.image_classifier import ImageClassifierHandler
from scripts.build_archives import (
    DEFAULT_DESCRIPTIONS,
    ModelDescription,
    build_archive,
    load_descriptions,
)
from tests.archives import load_classifier


def without_compile(description: ModelDescription) -> ModelDescription:
    return dataclasses.replace(description,
                               handler_options={**description.handler_options, "compile": False})


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model of config/models.yaml as described, built into a fresh model store. The
    classifier compiles its eight batch sizes when a worker starts (35-75 s per worker here)."""
    store = tmp_path_factory.mktemp("model_store")
    for description in load_descriptions(DEFAULT_DESCRIPTIONS):
        build_archive(description, store)
    return store


@pytest.fixture(scope="session")
def fast_start_model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same archives (names, versions, settings) with torch.compile off, so a worker starts in
    seconds: for the servers whose subject is not the compiled model (rollouts, faults, token
    authorization, the production config, the serving lab). The compiled model is served by the
    session `server` and checked in-process in tests/unit/test_precision_and_compile.py."""
    store = tmp_path_factory.mktemp("fast_start_model_store")
    for description in load_descriptions(DEFAULT_DESCRIPTIONS):
        build_archive(without_compile(description), store)
    return store


@pytest.fixture(scope="session")
def classifier(fast_start_model_store: Path,
               tmp_path_factory: pytest.TempPathFactory) -> ImageClassifierHandler:
    """The default classifier archive (without compile), loaded in-process (real weights, CPU)."""
    return load_classifier(fast_start_model_store / "efficientnet_lite0-1.0.mar",
                           tmp_path_factory.mktemp("extracted"))
