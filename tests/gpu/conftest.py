"""The device the GPU tests run on (`--gpu-device`, tests/conftest.py), and the gpu_id a
TorchServe worker on it is given (None for the CPU, where `--gpu-device cpu` rehearses them)."""

from __future__ import annotations

import pytest
import torch

from torchserve_vision.lab.gpu_lab import gpu_id_of


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    chosen = torch.device(request.config.getoption("--gpu-device"))
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise AssertionError(f"--gpu asks for {chosen}, and torch sees no CUDA device here")
    return chosen


@pytest.fixture(scope="session")
def gpu_id(device: torch.device) -> int | None:
    return gpu_id_of(device)
