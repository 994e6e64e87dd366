"""Reduced precision and torch.compile on the worker's device: which precision runs where, bf16
answers against fp32 on real photos, and a compiled classifier that never compiles on a request."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from handlers.image_classifier import ImageClassifierHandler
from handlers.model import model_loading
from handlers.model.model_loading import autocast, effective_precision
from tests.answers import assert_same_answer, default_classifier
from tests.archives import archive_context, load_classifier_dir, stage_model_dir
from tests.images import photo_bytes
from tests.runners import first_runner_here

CPU = torch.device("cpu")
CUDA = torch.device("cuda:0")
PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]
DEFAULT_CLASSIFIER = default_classifier()


@pytest.mark.parametrize(("asked", "device", "native_bf16", "runs"), [
    ("fp32", CPU, True, "fp32"),
    ("bf16", CPU, True, "bf16"),
    ("bf16", CPU, False, "fp32"),   # emulated bf16 is slower than fp32
    ("fp16", CPU, True, "fp32"),    # no fp16 compute on the CPU
    ("fp16", CUDA, False, "fp16"),
    ("bf16", CUDA, False, "bf16"),
    ("fp32", CUDA, False, "fp32"),
    ("tf32", CUDA, False, "tf32"),
    ("tf32", CPU, True, "fp32"),    # a CPU has no TF32
])
def test_effective_precision(asked, device, native_bf16, runs):
    assert effective_precision(asked, device, native_bf16) == runs


def test_bf16_autocast_on_the_cpu_computes_in_bf16_and_fp32_does_not():
    layer = nn.Linear(8, 4)
    inputs = torch.randn(2, 8)
    with torch.inference_mode():
        with autocast(CPU, "bf16"):
            assert layer(inputs).dtype == torch.bfloat16
        with autocast(CPU, "fp32"):
            assert layer(inputs).dtype == torch.float32


@pytest.fixture
def tf32_settings_kept() -> Any:
    # Process-wide settings of PyTorch's CUDA libraries (readable without a GPU); put back after.
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize(("precision", "tf32"), [("fp32", False), ("tf32", True), ("fp16", False)])
def test_on_cuda_float32_work_uses_tf32_only_under_the_tf32_precision(precision, tf32,
                                                                      tf32_settings_kept):
    """Set once, when a worker loads its network: a forward pass (autocast) leaves the
    process-wide flags as they are, so no thread of the worker ever sees them change under it."""
    from handlers.model.model_loading import use_tensor_float_32

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = not tf32
    use_tensor_float_32(CUDA, precision)
    assert torch.backends.cudnn.allow_tf32 is tf32
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    with autocast(CPU, "fp32"):
        assert torch.backends.cudnn.allow_tf32 is tf32
    use_tensor_float_32(CPU, "tf32" if not tf32 else "fp32")     # a CPU worker changes nothing
    assert torch.backends.cudnn.allow_tf32 is tf32


def test_autocast_leaves_the_cpus_float32_settings_alone(tf32_settings_kept):
    torch.backends.cudnn.allow_tf32 = True
    with autocast(CPU, "fp32"):
        assert torch.backends.cudnn.allow_tf32 is True


def classifier_variant(tmp_path: Path, batch_size: int, **handler_options: Any) -> ImageClassifierHandler:
    """The default classifier's description with some handler options changed, loaded in-process."""
    description = dataclasses.replace(
        DEFAULT_CLASSIFIER, handler_options={**DEFAULT_CLASSIFIER.handler_options, **handler_options})
    return load_classifier_dir(stage_model_dir(description, tmp_path), batch_size)


@contextmanager
def worker_threads() -> Iterator[None]:
    """Run requests with the archive's `torch_threads`, as in its worker (a compiled model's
    graphs are specialised on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(DEFAULT_CLASSIFIER.handler_options.get("torch_threads", threads)))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def answers(handler: ImageClassifierHandler, images: list[bytes]) -> list[list[dict]]:
    context = archive_context(handler.model_dir, request_headers=[{} for _ in images])
    with worker_threads():
        bodies = handler.handle([{"body": bytearray(image)} for image in images], context)
    assert all(context.status(index) == 200 for index in range(len(images)))
    return [json.loads(body) for body in bodies]


@pytest.fixture(scope="module")
def eager_fp32(tmp_path_factory: pytest.TempPathFactory) -> ImageClassifierHandler:
    return classifier_variant(tmp_path_factory.mktemp("eager"), 8, precision="fp32", compile=False)


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [photo_bytes(name) for name in PHOTOS]


@pytest.mark.slow
def test_bf16_answers_match_fp32_on_real_photos(eager_fp32, photos, tmp_path, monkeypatch):
    # Forced on, so the bf16 numerics are checked on any CPU (emulated where not native).
    monkeypatch.setattr(model_loading, "cpu_has_native_bf16", lambda: True)
    bf16 = classifier_variant(tmp_path, 8, precision="bf16", compile=False)
    assert bf16.precision == "bf16"
    reference = answers(eager_fp32, photos)
    assert len({answer[0]["index"] for answer in reference}) == len(PHOTOS)  # photos differ
    for got, expected in zip(answers(bf16, photos), reference, strict=True):
        assert_same_answer(got, expected, "bf16")
    for photo, alone in zip(photos, reference, strict=True):  # each batch size agrees too
        assert_same_answer(answers(bf16, [photo])[0], alone, "bf16")


def test_the_compiled_classifier_runs_its_first_runner_at_every_batch_size_and_matches_eager(
        classifier, eager_fp32, photos):
    from torch._dynamo.utils import counters

    assert DEFAULT_CLASSIFIER.handler_options.get("compile")
    model_yaml = archive_context(classifier.model_dir).model_yaml_config or {}
    assert classifier.runner == first_runner_here(model_yaml["handler"])
    assert classifier.runners["classifier"].refusals == ()
    graphs_before = counters["stats"]["unique_graphs"]
    reference = answers(eager_fp32, photos)
    for count in (1, 2, 3, 5, 2, 1):
        for got, expected in zip(answers(classifier, photos[:count]), reference[:count], strict=True):
            assert_same_answer(got, expected, classifier.precision)
    assert counters["stats"]["unique_graphs"] == graphs_before  # nothing compiles in a worker


def test_the_bf16_package_runs_where_the_cpu_has_native_bf16(classifier, eager_fp32, photos,
                                                              monkeypatch):
    # Forced on, so the bf16 package is loaded and checked on any CPU (emulated where not native).
    monkeypatch.setattr(model_loading, "cpu_has_native_bf16", lambda: True)
    bf16 = load_classifier_dir(classifier.model_dir)
    assert bf16.precision == "bf16" and bf16.runners["classifier"].precision == "bf16"
    for got, expected in zip(answers(bf16, photos), answers(eager_fp32, photos), strict=True):
        assert_same_answer(got, expected, "bf16")


def test_without_native_bf16_the_fp32_package_runs(classifier, monkeypatch):
    monkeypatch.setattr(model_loading, "cpu_has_native_bf16", lambda: False)
    fp32 = load_classifier_dir(classifier.model_dir)
    assert DEFAULT_CLASSIFIER.handler_options["precision"] == "bf16"
    assert fp32.precision == "fp32" and fp32.runners["classifier"].precision == "fp32"
    assert fp32.runner != "eager" and fp32.runners["classifier"].cpu_kind in ("avx512", "avx2")
