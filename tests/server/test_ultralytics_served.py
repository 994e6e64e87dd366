"""Ultralytics exports on a real TorchServe, from archives built by `torchserve-vision build
--source ultralytics` (YOLOv8n as TorchScript with a response cache and its drift reference
profile, and as ONNX; YOLOv8n-cls): concurrent requests over HTTP answered as Ultralytics'
own predict answers each file, options per request (class-agnostic NMS by header and by JSON
field), bad uploads refused alone, the cache and drift stages at work, and `predict --draw`
drawing the detections."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import requests
from PIL import Image

from tests.images import encode
from tests.server.http_client import concurrently
from tests.ultralytics_models import assert_ultralytics_answer, comparison_photos, offline_ultralytics
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.cli import main as command
from torchserve_vision.lab.compare import register, unregister_all
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.prometheus_text import scrape, total
from torchserve_vision.server_process import TorchServeInstance

pytestmark = pytest.mark.server
DETECTOR, ONNX_DETECTOR, CLASSIFIER = "yolo", "yolo_onnx", "yolo_cls"


def build(export: Path, store: Path, name: str, *flags: str) -> str:
    assert command(["build", "--name", name, "--version", "1.0", "--source", "ultralytics",
                    "--weights", str(export), "--model-store", str(store), *flags]) == 0
    return f"{name}-1.0.mar"


@pytest.fixture(scope="module")
def served(server: TorchServeInstance, model_store: Path,
           ultralytics_exports: dict[str, Path]) -> Iterator[TorchServeInstance]:
    """The three archives built into the session's model store and registered (batches of up to
    4, one worker each); the detector's with a response cache and a drift profile of 16 requests."""
    client = server.client(timeout_s=120)
    archives = {
        DETECTOR: build(ultralytics_exports["yolov8n.torchscript"], model_store, DETECTOR,
                        "--drift-reference-requests", "16"),
        ONNX_DETECTOR: build(ultralytics_exports["yolov8n.onnx"], model_store, ONNX_DETECTOR,
                             "--drift-reference-requests", "0"),
        CLASSIFIER: build(ultralytics_exports["yolov8n-cls.torchscript"], model_store, CLASSIFIER,
                          "--drift-reference-requests", "0"),
    }
    archives[DETECTOR] = archive_with_version(model_store, archives[DETECTOR], "1.0-cached",
                                              {"cache": {"memory_bytes": 8_000_000}})
    try:
        for name, archive in archives.items():
            register(client, model_store, archive, name, ServingSettings(4, 1, 1, 1))
        yield server
    finally:
        for name in archives:
            unregister_all(client, name)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("yolo-photos")
    files = {}
    for name, data in comparison_photos().items():
        files[name] = folder / name
        files[name].write_bytes(data)
    return files


def post(server: TorchServeInstance, model: str, body: bytes | dict[str, Any],
         headers: dict[str, str] | None = None) -> requests.Response:
    url = f"{server.inference_url}/predictions/{model}"
    if isinstance(body, dict):
        return requests.post(url, json=body, headers=headers, timeout=120)
    return requests.post(url, data=body, headers={"Content-Type": "application/octet-stream",
                                                  **(headers or {})}, timeout=120)


def ultralytics_model(export: Path, task: str) -> Any:
    from ultralytics import YOLO

    return YOLO(str(export), task=task)


def test_concurrent_requests_are_answered_as_ultralytics_predict_answers_each_file(served, photos,
                                                                                   ultralytics_exports):
    for model, export in ((DETECTOR, "yolov8n.torchscript"), (ONNX_DETECTOR, "yolov8n.onnx")):
        replies = concurrently([partial(post, served, model, path.read_bytes(), {"X-Cache": "bypass"})
                                for path in photos.values()], len(photos))
        assert [reply.status_code for reply in replies] == [200] * len(photos)
        assert max(int(reply.headers["X-Batch-Size"]) for reply in replies) > 1
        with offline_ultralytics():
            reference = ultralytics_model(ultralytics_exports[export], "detect")
            for reply, path in zip(replies, photos.values(), strict=True):
                assert_ultralytics_answer(reply.json(), reference.predict(str(path), verbose=False)[0], 0.25)


def test_class_agnostic_nms_by_header_and_by_json_field(served, photos, ultralytics_exports):
    path = photos["motorcycle-large.jpg"]
    by_header = post(served, DETECTOR, path.read_bytes(),
                     {"X-Agnostic-NMS": "true", "X-Score-Threshold": "0.1"})
    by_field = post(served, DETECTOR, {"data": base64.b64encode(path.read_bytes()).decode(),
                                       "agnostic_nms": True, "score_threshold": 0.1})
    class_aware = post(served, DETECTOR, path.read_bytes(), {"X-Score-Threshold": "0.1"})
    assert by_header.status_code == by_field.status_code == 200, (by_header.text, by_field.text)
    assert by_header.json() == by_field.json()
    assert len(by_header.json()) < len(class_aware.json())      # overlaps of other classes suppressed
    with offline_ultralytics():
        result = ultralytics_model(ultralytics_exports["yolov8n.torchscript"], "detect").predict(
            str(path), verbose=False, agnostic_nms=True, conf=0.1)[0]
    assert_ultralytics_answer(by_header.json(), result, 0.1, "agnostic")


def test_bad_uploads_are_refused_alone_and_their_batch_mates_answered(served, photos):
    good = photos["astronaut.png"].read_bytes()
    bodies = [good, b"not an image", good[: len(good) // 3], good, b""]
    replies = concurrently([partial(post, served, DETECTOR, body, {"X-Cache": "bypass"}) for body in bodies],
                           len(bodies))
    statuses = [reply.status_code for reply in replies]
    assert statuses[0] == statuses[3] == 200 and replies[0].json() == replies[3].json()
    assert all(400 <= status < 500 for status in statuses[1:3] + statuses[4:]), statuses
    assert all("type" in replies[index].json() for index in (1, 2, 4))


def test_a_repeat_is_answered_from_the_cache_and_the_drift_stage_counts_what_was_answered(served, photos):
    with Image.open(photos["horse-small.png"]) as horse:          # bytes no other test sent
        image = encode(horse.transpose(Image.Transpose.FLIP_LEFT_RIGHT), "PNG")
    first, again = post(served, DETECTOR, image), post(served, DETECTOR, image)
    assert (first.headers["X-Cache"], again.headers["X-Cache"]) == ("miss", "hit")
    assert first.json() == again.json()
    metrics = scrape(served.metrics_url)
    assert total(metrics, "HandlerDriftReference", ModelName=DETECTOR) > 0       # the archive's profile
    assert total(metrics, "HandlerDriftObserved", ModelName=DETECTOR) > 0


def test_the_classification_export_answers_ultralytics_top_5(served, photos, ultralytics_exports):
    with offline_ultralytics():
        reference = ultralytics_model(ultralytics_exports["yolov8n-cls.torchscript"], "classify")
        for path in list(photos.values())[:4]:
            reply = post(served, CLASSIFIER, path.read_bytes())
            assert reply.status_code == 200, reply.text
            probs = reference.predict(str(path), verbose=False)[0].probs
            assert [row["index"] for row in reply.json()] == list(probs.top5)


def test_predict_draws_the_detections_on_the_photo(served, photos, tmp_path, capsys):
    drawing = tmp_path / "motorcycle.png"
    assert command(["predict", str(photos["motorcycle-portrait.jpg"]), "--model", DETECTOR, "--draw",
                    str(drawing), "--inference-url", served.inference_url,
                    "--management-url", served.management_url]) == 0
    out = capsys.readouterr().out
    assert f"drawn: {drawing}" in out
    with Image.open(drawing) as image, Image.open(photos["motorcycle-portrait.jpg"]) as photo:
        assert image.size[0] == photo.size[0] and image.size[1] >= photo.size[1]
        assert image.convert("RGB").crop((0, 0, *photo.size)).tobytes() != photo.convert("RGB").tobytes()
