"""handlers.model.gil_free_package: the archive's real packages run through the C interface give
torch's loader's answers bit for bit, refuse a wrong input, and leave the GIL to other threads
(torch's own entry points hold it for the whole forward pass: docs/benchmarks.md)."""

from __future__ import annotations

import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from handlers.image_classifier import ImageClassifierHandler
from handlers.model.compiled_model import load_probe_photos
from handlers.model.gil_free_package import GilFreePackage, UnsupportedPackage


@pytest.fixture(scope="module")
def fp32_package(classifier: ImageClassifierHandler) -> Path:
    return classifier.model_dir / "compiled" / "model-fp32.pt2"


@pytest.fixture(scope="module")
def model_inputs(classifier: ImageClassifierHandler) -> torch.Tensor:
    """float32[N, 3, 224, 224] channels-last: the archive's probe photos as the package reads them
    (the archive's worker may serve another runner, which reads plain NCHW)."""
    photos = load_probe_photos(classifier.model_dir)
    assert classifier.settings.channels_last
    return classifier.classifier.crops_input(photos.float()).contiguous(memory_format=torch.channels_last)


def torch_loader(path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch._inductor

    return torch._inductor.aoti_load_package(str(path))


def test_answers_are_torchs_loaders_bit_for_bit_at_every_batch_size(fp32_package, model_inputs):
    ours, theirs = GilFreePackage(fp32_package), torch_loader(fp32_package)
    for count in (1, 3, len(model_inputs)):
        batch = model_inputs[:count]
        got = ours(batch)
        assert got.shape == (count, 1000)
        assert torch.equal(got, theirs(batch))
    assert not torch.equal(ours(model_inputs[:1]), ours(model_inputs[1:2]))  # photos differ


def test_a_wrong_input_is_refused_instead_of_read_out_of_bounds(fp32_package, model_inputs,
                                                                monkeypatch):
    # as compiled_model.load_aoti_package sets it for a worker (read at a package's first call)
    monkeypatch.setenv("AOTI_RUNTIME_CHECK_INPUTS", "1")
    package = GilFreePackage(fp32_package)
    with pytest.raises(RuntimeError, match="running the model"):
        package(model_inputs[:1, :, :200, :200].contiguous(memory_format=torch.channels_last))
    with pytest.raises(RuntimeError, match="running the model"):
        package(model_inputs[:1].contiguous())          # channels-first strides
    assert package(model_inputs[:1]).shape == (1, 1000)  # and it still serves


@pytest.fixture
def switch_only_when_released() -> Iterator[None]:
    """A thread holding the GIL keeps it until it blocks or releases it in a C call: with an
    interval of 1000 s the interpreter never takes it away."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    yield
    sys.setswitchinterval(interval)


def ran_during_a_forward_pass(run: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor) -> bool:
    """Whether this thread got to run Python while another thread was inside `run(batch)`."""
    marks: list[str] = []

    def forward_passes() -> None:
        for _ in range(5):
            marks.append("inside")
            run(batch)
            marks.append("returned")

    worker = threading.Thread(target=forward_passes)
    worker.start()
    seen_inside = False
    while worker.is_alive() and not seen_inside:
        seen_inside = bool(marks) and marks[-1] == "inside"
        time.sleep(0.0005)   # blocks, so the worker may take the GIL
    worker.join()
    return seen_inside


def python_busy_loop(batch: torch.Tensor) -> torch.Tensor:
    for _ in range(200_000):
        pass
    return batch


def test_other_threads_run_during_the_forward_pass(fp32_package, model_inputs,
                                                   switch_only_when_released):
    batch = model_inputs[:1].expand(8, -1, -1, -1).contiguous(memory_format=torch.channels_last)
    assert ran_during_a_forward_pass(GilFreePackage(fp32_package), batch)
    # The check can fail: code that keeps the GIL lets no other thread in.
    assert not ran_during_a_forward_pass(python_busy_loop, batch)


def package_with(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as package:
        for name in names:
            package.writestr(name, b"")
    return path


@pytest.mark.parametrize(("names", "reason"), [
    (["m/data/aotinductor/model/a.wrapper.so", "m/data/weights/w0"], "weights outside"),
    (["m/data/aotinductor/model/a.wrapper.so", "m/data/constants/c0"], "weights outside"),
    (["m/data/aotinductor/model/a.so", "m/data/aotinductor/model/b.so"], "one model library"),
    (["m/data/aotinductor/model/a.wrapper.cpp"], "one model library"),
])
def test_packages_it_cannot_run_are_named_unsupported(tmp_path, names, reason):
    with pytest.raises(UnsupportedPackage, match=reason):
        GilFreePackage(package_with(tmp_path / "model.pt2", names))
