"""The lab's single-session baselines (torchserve_vision/lab/single_session.py): a user's Pillow
preprocessing, and one shared ONNX Runtime session of the archive's network answering real
photos as our own handler does, behind the same threaded server as our engine."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import requests
from PIL import Image

from handlers.model.settings import parse_classifier_settings
from tests.images import photo_bytes
from tests.runners import engine_threads, threads_given
from torchserve_vision.lab.single_session import (
    engine_answer,
    onnx_session,
    pillow_input,
    single_session_handler,
    threaded_server,
)
from torchserve_vision.local_handler import eager_classifier, extract_archive, load_handler


def test_pillow_preprocessing_resizes_crops_and_normalises():
    settings = parse_classifier_settings({
        "model": {"source": "timm", "architecture": "test_efficientnet"},
        "preprocess": {"resize_size": 72, "input_size": 64, "mean": [0.5] * 3, "std": [0.5] * 3}})
    buffer = io.BytesIO()
    Image.new("RGB", (300, 200), (255, 0, 128)).save(buffer, format="PNG")
    pixels = pillow_input(buffer.getvalue(), settings)
    assert pixels.shape == (1, 3, 64, 64) and pixels.dtype == np.float32
    expected = [(1 - 0.5) / 0.5, (0 - 0.5) / 0.5, (128 / 255 - 0.5) / 0.5]
    assert np.allclose(pixels[0, :, 0, 0], expected, atol=1e-6)


def test_onnx_runtime_and_our_engine_give_the_same_best_classes(model_store: Path, tmp_path: Path):
    model_dir = extract_archive(model_store / "efficientnet_lite0-1.0.mar", tmp_path / "model")
    handler = load_handler(model_dir, batch_size=1)
    photos = ["chelsea.png", "coffee.png", "motorcycle_left.png"]
    with (onnx_session(model_dir) as answer_with, threaded_server(answer_with(1)) as onnx_url,
          threaded_server(engine_answer(handler, str(model_dir))) as engine_url):
        for photo in photos:
            onnx = requests.post(onnx_url, data=photo_bytes(photo), timeout=60)
            ours = requests.post(engine_url, data=photo_bytes(photo), timeout=60)
            assert onnx.status_code == ours.status_code == 200
            assert onnx.json()[0]["label"] == ours.json()[0]["label"], photo
        refused = requests.post(onnx_url, data=b"not an image", timeout=60)
        assert refused.status_code == 400
    assert eager_classifier(model_dir)[0].input_size == 224


def test_our_engines_session_computes_on_the_threads_it_is_measured_at(model_store: Path, tmp_path: Path):
    # Loaded per thread count: an engine with threads of its own fixes them when it loads, and a
    # session is one load (no second one at solo threads).
    model_dir = extract_archive(model_store / "efficientnet_lite0-1.0.mar", tmp_path / "model")
    for threads in (1, 2):
        runner = single_session_handler(model_dir, threads).classifier.run
        assert engine_threads(runner) == threads_given(threads, runner)
