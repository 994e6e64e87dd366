"""The OpenVINO runner's model cache, shared by a model's workers (handlers/model/engine_runners)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from handlers.model.engine_runners import OPENVINO_CACHE_LOCK, OpenVinoRunner, exclusive_lock
from handlers.model.openvino_package import openvino_package

openvino = openvino_package()


@pytest.fixture(scope="module")
def small_ir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small convolutional network's IR (fixed seed): compiles in milliseconds."""
    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                  torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval()
    path = tmp_path_factory.mktemp("ir") / "model.xml"
    openvino.save_model(openvino.convert_model(network, example_input=torch.zeros(1, 3, 16, 16)), str(path))
    return path


BATCH = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def blobs(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.blob"))


def test_a_worker_waits_while_another_compiles_into_the_cache_then_loads_its_blob(small_ir, tmp_path):
    """While one worker holds the cache (compiling and writing the blob), another does not read
    the half-written blob: it waits, then loads the blob the first wrote (no second blob)."""
    cache = tmp_path / "openvino-cache"
    cache.mkdir()
    first = OpenVinoRunner(small_ir, "fp32", 1, cache)
    assert len(blobs(cache)) == 1
    loaded: list[OpenVinoRunner] = []
    with exclusive_lock(cache / OPENVINO_CACHE_LOCK):      # another worker compiling
        waiting = threading.Thread(target=lambda: loaded.append(OpenVinoRunner(small_ir, "fp32", 1, cache)))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not loaded
    waiting.join(60)
    assert len(loaded) == 1 and len(blobs(cache)) == 1
    torch.testing.assert_close(loaded[0](BATCH), first(BATCH), rtol=0, atol=0)


def test_a_cache_that_fails_costs_a_compile_without_it_not_the_runner(small_ir, tmp_path, caplog):
    not_a_directory = tmp_path / "openvino-cache"
    not_a_directory.write_text("")
    with caplog.at_level(logging.WARNING, logger="handlers.model.engine_runners"):
        runner = OpenVinoRunner(small_ir, "fp32", 1, not_a_directory)
    assert any("compiling without it" in record.getMessage() for record in caplog.records)
    uncached = OpenVinoRunner(small_ir, "fp32", 1, None)
    torch.testing.assert_close(runner(BATCH), uncached(BATCH), rtol=0, atol=0)
