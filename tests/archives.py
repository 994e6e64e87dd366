"""Open built archives in-process for tests (see torchserve_vision/local_handler.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from handlers.image_classifier import ImageClassifierHandler
from handlers.object_detector import ObjectDetectorHandler
from handlers.serving import BatchedImageHandler
from torchserve_vision.archives import BuildTarget
from torchserve_vision.archives.build import stage_files
from torchserve_vision.local_handler import archive_context, extract_archive
from torchserve_vision.model_descriptions import ModelDescription

# The session's archives record their drift reference profiles from fewer requests than a user's
# build (192): what the tests check of a profile does not depend on its size, and the detector's
# takes 16 s at 192 (tests/unit/test_build_archives.py builds one at the default size).
TEST_REFERENCE_REQUESTS = 48

__all__ = ["archive_context", "extract_archive", "load_classifier", "load_classifier_dir",
           "load_detector", "photo_answers", "stage_model_dir"]

Handler = TypeVar("Handler", bound=BatchedImageHandler[Any, Any, Any, Any])


def load_classifier(mar_path: Path, work_dir: Path, batch_size: int = 8) -> ImageClassifierHandler:
    return load_classifier_dir(extract_archive(mar_path, work_dir / mar_path.stem), batch_size)


@contextmanager
def process_threads_kept() -> Iterator[None]:
    """A handler's `torch_threads` is meant for its worker process; keep the test process's own."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def stage_model_dir(description: ModelDescription, target: Path, build_target: BuildTarget = "cpu") -> Path:
    """The directory a worker would see for `description` (built for `build_target`'s workers),
    staged without zipping an archive (for large test models; the archiver itself is exercised
    by the other tests)."""
    weights = stage_files(description, target, build_target)
    model_dir = target / "extra"
    shutil.move(weights, model_dir / weights.name)
    shutil.move(target / "model-config.yaml", model_dir / "model-config.yaml")
    manifest = {"model": {"modelName": description.name, "modelVersion": description.version,
                          "serializedFile": weights.name, "configFile": "model-config.yaml",
                          "handler": description.kind.entry_module}}
    (model_dir / "MAR-INF").mkdir()
    (model_dir / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(manifest))
    return model_dir


def initialized(handler: Handler, model_dir: Path, batch_size: int, metrics: Any = None) -> Handler:
    """`handler` initialized from an extracted or staged model directory, as a worker would
    (with `metrics`, a stand-in for TorchServe's metrics cache, when given)."""
    context = archive_context(model_dir, batch_size)
    context.metrics = metrics
    with process_threads_kept():
        handler.initialize(context)
    return handler


def load_detector(model_dir: Path, batch_size: int = 4) -> ObjectDetectorHandler:
    return initialized(ObjectDetectorHandler(), model_dir, batch_size)


def load_classifier_dir(model_dir: Path, batch_size: int = 8, metrics: Any = None) -> ImageClassifierHandler:
    """A classifier from a staged (not zipped) model directory; see `stage_model_dir`."""
    return initialized(ImageClassifierHandler(), model_dir, batch_size, metrics)


def photo_answers(handler: ImageClassifierHandler, photos: list[str]) -> list[list[dict]]:
    """The handler's answers to scikit-image's `photos`, sent as one batch; every one a 200."""
    from tests.images import photo_bytes

    context = archive_context(handler.model_dir, request_headers=[{} for _ in photos])
    bodies = handler.handle([{"body": bytearray(photo_bytes(name))} for name in photos], context)
    assert all(context.status(index) == 200 for index in range(len(photos)))
    return [json.loads(body) for body in bodies]
