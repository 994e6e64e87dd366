"""The device the GPU tests run on (`--gpu-device`, tests/conftest.py), the gpu_id a
TorchServe worker on it is given (None for the CPU, where `--gpu-device cpu` rehearses them),
and the default classifier staged for GPU workers at fp16."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.answers import default_classifier
from tests.archives import stage_model_dir
from torchserve_vision.lab.gpu_lab import gpu_id_of


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    chosen = torch.device(request.config.getoption("--gpu-device"))
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise AssertionError(f"--gpu asks for {chosen}, and torch sees no CUDA device here")
    return chosen


@pytest.fixture(scope="module")
def lite0_fp16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default classifier's archive staged for GPU workers at fp16."""
    description = dataclasses.replace(default_classifier(), handler_options={
        **default_classifier().handler_options, "precision": "fp16"})
    return stage_model_dir(description, tmp_path_factory.mktemp("lite0-fp16"), "gpu")


@pytest.fixture(scope="session")
def gpu_id(device: torch.device) -> int | None:
    return gpu_id_of(device)
