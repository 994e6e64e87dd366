"""Bad and awkward payloads, interleaved with good ones under concurrency, on a real TorchServe;
plus the handler metrics and logs that traffic leaves behind."""

from __future__ import annotations

import base64
import functools
import io
import random
import re
import shutil
import time

import numpy as np
import pytest
import requests
from PIL import Image

from tests.answers import assert_same_answer, served_classifier_precision
from tests.images import CAT_LABELS, bad_payloads, encode, exif_with_orientation, photo_bytes
from tests.server.http_client import concurrently
from tests.server.logs import file_lines, rejected_requests, wait_for_log
from torchserve_vision.server_process import TorchServeInstance, ping

pytestmark = pytest.mark.server
CAT = Image.open(io.BytesIO(photo_bytes("chelsea.png"))).convert("RGB")


def url(server: TorchServeInstance) -> str:
    return f"{server.inference_url}/predictions/efficientnet_lite0"


def awkward_payloads() -> dict[str, bytes]:
    """Valid images of unusual kinds, all showing the cat, except the 1x1."""
    gray16 = (np.asarray(CAT.convert("L")).astype(np.uint16) * 257)
    return {
        "grayscale": encode(CAT.convert("L"), "PNG"),
        "cmyk jpeg": encode(CAT.convert("CMYK"), "JPEG", quality=92),
        "rgba png": encode(CAT.convert("RGBA"), "PNG"),
        "16-bit png": encode(Image.fromarray(gray16), "PNG"),
        "animated gif": encode(CAT.convert("P"), "GIF", save_all=True,
                               append_images=[CAT.rotate(180).convert("P")]),
        "webp": encode(CAT, "WEBP", quality=90),
        "6000x4000 jpeg": encode(CAT.resize((6000, 4000)), "JPEG", quality=85),
        "exif-rotated jpeg": encode(CAT.transpose(Image.Transpose.ROTATE_90), "JPEG", quality=92,
                                    exif=exif_with_orientation(6)),
    }


def post(server: TorchServeInstance, body: bytes, content_type: str) -> requests.Response:
    return requests.post(url(server), data=body, headers={"Content-Type": content_type}, timeout=120)


def test_a_battery_of_bad_and_awkward_payloads_under_concurrency(server, classifier):
    bad, awkward = bad_payloads(), awkward_payloads()
    good = {name: photo_bytes(name) for name in ("chelsea.png", "coffee.png", "rocket.jpg")}
    expected_good = {name: json_top(classifier, body) for name, body in good.items()}
    jobs: list[tuple[str, str, bytes, str]] = []
    for _ in range(3):
        jobs += [("bad", name, body, content_type) for name, (body, content_type, _) in bad.items()]
        jobs += [("awkward", name, body, "application/octet-stream") for name, body in awkward.items()]
        jobs += [("good", name, body, "application/octet-stream")
                 for name, body in good.items() for _ in range(2)]
        jobs.append(("awkward", "1x1", encode(Image.new("RGB", (1, 1), (200, 90, 40)), "PNG"),
                     "image/png"))
    random.Random(3).shuffle(jobs)
    answers = concurrently([functools.partial(post, server, body, kind)
                            for _, _, body, kind in jobs], clients=12)
    for (category, name, _, _), answer in zip(jobs, answers, strict=True):
        if category == "bad":
            assert answer.status_code == bad[name][2], (name, answer.text)
            assert answer.json()["code"] == bad[name][2] and answer.json()["message"], name
        elif category == "awkward":
            assert answer.status_code == 200, (name, answer.text)
            assert len(answer.json()) == 5
            if name != "1x1":
                assert answer.json()[0]["label"] in CAT_LABELS, (name, answer.json()[0])
        else:
            assert_same_answer(answer.json(), expected_good[name], served_classifier_precision(),
                               classifier.precision)
    assert ping(server)
    assert post(server, good["coffee.png"], "image/png").json()[0]["label"] == "espresso"


def json_top(classifier, body: bytes) -> list[dict]:
    """The in-process handler's answer for `body` (the reference answer)."""
    import json

    from tests.archives import archive_context

    answer = classifier.handle([{"body": bytearray(body)}], archive_context(classifier.model_dir))
    return json.loads(answer[0])


def test_an_upload_over_max_request_size_gets_413_not_a_dropped_connection(server):
    answer = post(server, b"\x00" * 7_000_000, "application/octet-stream")
    assert answer.status_code == 413
    assert ping(server)


def test_registration_from_outside_the_model_store_is_refused(server, model_store, tmp_path):
    look_alike = tmp_path / "model_store"   # a folder of the same name elsewhere on disk
    look_alike.mkdir()
    shutil.copy(model_store / "ssd_mobilenet_v2-1.0.mar", look_alike / "elsewhere.mar")
    for outside in ("file:///etc/passwd", "file:///tmp/elsewhere/model.mar",
                    "http://127.0.0.1:9/model.mar", f"file://{look_alike}/elsewhere.mar"):
        answer = requests.post(f"{server.management_url}/models", params={"url": outside}, timeout=30)
        assert answer.status_code == 404, outside
        assert "allowed" in answer.json()["message"]
    assert not (model_store / "elsewhere.mar").exists()


def test_a_file_url_inside_the_model_store_passes_the_url_check(server, model_store):
    """TorchServe copies an allowed file:// URL into the store: for a file already there it
    answers (500, TorchServe 0.12's status for it) that the file exists, which shows the URL
    passed `allowed_urls` (a refused URL gets 404 "does not match any allowed URL")."""
    answer = requests.post(f"{server.management_url}/models", timeout=60, params={
        "url": f"file://{model_store}/ssd_mobilenet_v2-1.0.mar", "initial_workers": "0"})
    assert "Model file already exists" in answer.json()["message"], answer.text


def test_worker_sockets_live_in_the_instance_own_temp_folder(server):
    assert list(server.tmp_dir.glob(".ts.sock.*"))


def metric_values(server: TorchServeInstance, name: str) -> dict[str, float]:
    """Prometheus samples of `name` for efficientnet_lite0: label text -> value."""
    text = requests.get(f"{server.metrics_url}/metrics", timeout=30).text
    pattern = re.compile(rf"^{name}\{{(.*ModelName=\"efficientnet_lite0\".*)\}} (\S+)$", re.M)
    return {labels: float(value) for labels, value in pattern.findall(text)}


def test_handler_metrics_reach_prometheus(server):
    post(server, b"definitely not an image", "image/jpeg")
    bodies = [photo_bytes("chelsea.png")] * 12
    concurrently([functools.partial(post, server, body, "image/png") for body in bodies], clients=12)
    (batch_size,) = metric_values(server, "HandlerBatchSize").values()
    (requests_total,) = metric_values(server, "HandlerRequests").values()
    (batches,) = metric_values(server, "HandlerBatches").values()
    (inference_ms,) = metric_values(server, "HandlerInferenceMs").values()
    (decode_ms,) = metric_values(server, "HandlerDecodeMs").values()
    rejected = metric_values(server, "HandlerRejectedRequests")
    assert 1 <= batch_size <= 8
    assert requests_total >= 13 and 1 <= batches < requests_total  # batches formed
    assert 1 < inference_ms < 60_000 and 0 < decode_ms < 60_000
    assert any('Reason="NotAnImage"' in labels and value >= 1 for labels, value in rejected.items())


def test_request_payloads_never_reach_the_logs(server):
    marker = "PRIVATE-PAYLOAD-4c1d"
    model_log = server.log_dir / "model_log.log"
    since = time.time()
    post(server, marker.encode(), "image/jpeg")
    requests.post(url(server), timeout=30,
                  json={"data": base64.b64encode(marker.encode()).decode()})
    # Logs are written by a background thread: wait until both rejections are in the worker log.
    lines = wait_for_log(model_log, lambda lines: rejected_requests(lines, since) >= 2)
    assert rejected_requests(lines, since) == 2
    for log in server.log_dir.iterdir():  # the logs and the files they rolled over into
        text = "\n".join(file_lines(log))
        assert marker not in text and base64.b64encode(marker.encode()).decode() not in text, log
