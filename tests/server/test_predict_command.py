"""`torchserve-vision predict` against a real TorchServe: folders in one command (JSON lines, a bad
image's own line, drawings at their relative paths, --resume), and a clear message and exit
status, never a traceback, for each input it cannot use."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from PIL import Image

from tests.images import PHOTOS_DIR, photo_bytes
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.cli import main as command
from torchserve_vision.server_process import TorchServeInstance

pytestmark = pytest.mark.server
DETECTOR, CLASSIFIER = "ssd_mobilenet_v2", "efficientnet_lite0"


def predict(server: TorchServeInstance, *arguments: str) -> int:
    return command(["predict", *arguments, "--inference-url", server.inference_url,
                    "--management-url", server.management_url])


def answer_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def photo_folder(tmp_path: Path) -> Path:
    """Three photos (one in a subfolder), a file that is not an image, and a broken PNG."""
    folder = tmp_path / "photos"
    (folder / "kitchen").mkdir(parents=True)
    for name in ("astronaut.png", "chelsea.png"):
        shutil.copy(PHOTOS_DIR / name, folder / name)
    shutil.copy(PHOTOS_DIR / "coffee.png", folder / "kitchen" / "coffee.png")
    (folder / "notes.txt").write_text("not an image")
    (folder / "kitchen" / "broken.png").write_bytes(photo_bytes("coffee.png")[:2000])
    return folder


def test_a_folder_gets_a_line_per_image_and_a_bad_image_its_own_error(server, photo_folder, tmp_path,
                                                                      capsys):
    out = tmp_path / "answers.jsonl"
    drawn = tmp_path / "drawn"
    status = predict(server, str(photo_folder), "--model", DETECTOR, "--out", str(out), "--draw", str(drawn))
    assert status == 1
    lines = {Path(line["path"]).relative_to(photo_folder).as_posix(): line for line in answer_lines(out)}
    assert sorted(lines) == ["astronaut.png", "chelsea.png", "kitchen/broken.png", "kitchen/coffee.png"]
    broken = lines["kitchen/broken.png"]
    assert broken["status"] == 400 and broken["error"]["type"] == "UndecodableImage"
    assert "person" in {found["label"] for found in lines["astronaut.png"]["answer"]}
    coffee = {found["label"] for found in lines["kitchen/coffee.png"]["answer"]}
    assert {"cup", "bowl", "dining table"} <= coffee
    assert all(line["latency_ms"] > 0 for line in lines.values())
    summary = capsys.readouterr().err
    assert "answered 3, failed 1" in summary and "1 file(s) that are not images left out" in summary
    # drawings at their paths below the folder, the photo's size, boxes drawn on it
    drawing = drawn / "kitchen" / "coffee.png"
    assert sorted(path.relative_to(drawn).as_posix() for path in drawn.rglob("*.png")) == [
        "astronaut.png", "chelsea.png", "kitchen/coffee.png"]
    with Image.open(drawing) as image, Image.open(PHOTOS_DIR / "coffee.png") as photo:
        assert image.size == photo.size
        assert image.convert("RGB").tobytes() != photo.convert("RGB").tobytes()


def test_one_photo_prints_a_table_and_draws_it(server, tmp_path, capsys):
    drawing = tmp_path / "cat.png"
    assert predict(server, str(PHOTOS_DIR / "chelsea.png"), "--draw", str(drawing)) == 0
    out = capsys.readouterr().out
    assert "tiger cat" in out and f"drawn: {drawing}" in out
    with Image.open(drawing) as image, Image.open(PHOTOS_DIR / "chelsea.png") as photo:
        assert image.size[0] == photo.size[0] and image.size[1] > photo.size[1]   # the caption's band


def test_resume_skips_the_answered_retries_the_failed_and_cuts_a_partial_line(server, photo_folder,
                                                                               tmp_path, capsys):
    (photo_folder / "kitchen" / "broken.png").unlink()
    out = tmp_path / "answers.jsonl"
    answered = {"path": str(photo_folder / "astronaut.png"), "status": 200, "latency_ms": 1.0,
                "answer": ["kept as it was"]}
    failed = {"path": str(photo_folder / "chelsea.png"), "status": 503, "latency_ms": 1.0,
              "error": {"message": "queue full"}}
    out.write_text(json.dumps(answered) + "\n" + json.dumps(failed) + "\n"
                   + '{"path": "' + str(photo_folder / "kitchen"))        # a run killed mid-line
    assert predict(server, str(photo_folder), "--model", DETECTOR, "--out", str(out), "--resume") == 0
    lines = answer_lines(out)
    assert lines[:2] == [answered, failed]
    retried = {line["path"]: line["status"] for line in lines[2:]}
    assert retried == {str(photo_folder / "chelsea.png"): 200,
                       str(photo_folder / "kitchen" / "coffee.png"): 200}
    assert "answered 2, failed 0, skipped 1" in capsys.readouterr().err
    assert predict(server, str(photo_folder), "--out", str(out), "--resume", "--model", DETECTOR) == 0
    assert len(answer_lines(out)) == 4          # nothing left to send


@pytest.mark.parametrize(("make", "message"), [
    (lambda tmp: [str(tmp / "missing.jpg")], "missing.jpg: no such file or folder"),
    (lambda tmp: [str(tmp / "empty")], "no images in"),
    (lambda tmp: [str(PHOTOS_DIR / "chelsea.png"), "--resume"], "--resume needs --out"),
])
def test_unusable_paths_get_a_message_and_status_1(server, tmp_path, capsys, make, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("text")
    assert predict(server, *make(tmp_path)) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_server_that_is_not_running_gets_a_message(tmp_path, capsys):
    code = command(["predict", str(PHOTOS_DIR / "chelsea.png"), "--inference-url", "http://127.0.0.1:9",
                    "--management-url", "http://127.0.0.1:9"])
    assert code == 1
    err = capsys.readouterr().err
    assert "cannot reach TorchServe's inference API at http://127.0.0.1:9" in err
    assert "torchserve-vision server start" in err


def test_an_unknown_model_or_version_gets_a_message_naming_what_is_served(server, capsys):
    assert predict(server, str(PHOTOS_DIR / "chelsea.png"), "--model", "nonexistent") == 1
    err = capsys.readouterr().err
    assert "does not serve nonexistent" in err and CLASSIFIER in err and DETECTOR in err
    assert predict(server, str(PHOTOS_DIR / "chelsea.png"), "--version", "9.9") == 1
    assert f"does not serve {CLASSIFIER} 9.9" in capsys.readouterr().err


def test_a_version_without_a_ready_worker_gets_a_message(server, model_store, capsys):
    copy = archive_with_version(model_store, f"{CLASSIFIER}-1.0.mar", "0.9-idle")
    answer = requests.post(f"{server.management_url}/models", timeout=120,
                           params={"url": copy, "initial_workers": "0", "synchronous": "true"})
    assert answer.status_code == 200, answer.text
    try:
        assert predict(server, str(PHOTOS_DIR / "chelsea.png"), "--version", "0.9-idle") == 1
        assert "has no READY worker" in capsys.readouterr().err
    finally:
        requests.delete(f"{server.management_url}/models/{CLASSIFIER}/0.9-idle", timeout=60)
        (model_store / copy).unlink()


def test_a_full_queue_is_waited_for_and_every_image_answered(server, model_store, tmp_path, capsys):
    """A version whose queue holds 2 (its archive's jobQueueSize) and whose one worker takes
    batches of 4, sent 16 photos at once: the server refuses what does not fit with 503 and
    Retry-After, `predict` sends those again after it, and every photo is answered."""
    copy = archive_with_version(model_store, f"{CLASSIFIER}-1.0.mar", "0.8-small-queue",
                                frontend_changes={"jobQueueSize": 2})
    answer = requests.post(f"{server.management_url}/models", timeout=120,
                           params={"url": copy, "initial_workers": "1", "batch_size": "4",
                                   "max_batch_delay": "50", "synchronous": "true"})
    assert answer.status_code == 200, answer.text
    folder = tmp_path / "photos"
    folder.mkdir()
    for index in range(16):
        shutil.copy(PHOTOS_DIR / "chelsea.png", folder / f"cat-{index:02d}.png")
    out = tmp_path / "answers.jsonl"
    try:
        assert predict(server, str(folder), "--version", "0.8-small-queue", "--out", str(out),
                       "--concurrency", "16") == 0
        summary = capsys.readouterr().err
        lines = answer_lines(out)
        assert [line["status"] for line in lines] == [200] * 16, summary
        assert all(line["answer"][0]["label"] == "tiger cat" for line in lines)
        assert "answered 16, failed 0 of 16 images; " in summary and "503 sent again" in summary, summary
        # without --concurrency: no more than the queue and the worker's batch hold
        assert predict(server, str(folder), "--version", "0.8-small-queue", "--out", str(out)) == 0
        assert "answered 16, failed 0 of 16 images; " in capsys.readouterr().err
    finally:
        requests.delete(f"{server.management_url}/models/{CLASSIFIER}/0.8-small-queue", timeout=60)
        (model_store / copy).unlink()


def test_out_is_checked_before_anything_is_sent(server, photo_folder, tmp_path, capsys):
    (photo_folder / "kitchen" / "broken.png").unlink()
    notes = tmp_path / "notes.txt"
    notes.write_text("shopping\nmilk")                          # no final newline
    for flags, message in [(["--out", str(tmp_path)], "is a folder"),
                           (["--out", str(notes), "--resume"], "line 1: not an answer line")]:
        assert predict(server, str(photo_folder), *flags) == 1
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert notes.read_text() == "shopping\nmilk"
    nested = tmp_path / "new" / "folder" / "answers.jsonl"       # a missing folder is made
    assert predict(server, str(photo_folder), "--out", str(nested)) == 0
    assert len(answer_lines(nested)) == 3
    # the same folder given as typed and as an absolute path: the same images, nothing resent
    relative = Path(os.path.relpath(photo_folder))
    assert predict(server, str(relative), str(photo_folder), "--out", str(nested), "--resume") == 0
    assert "answered 0, failed 0, skipped 3" in capsys.readouterr().err
    assert len(answer_lines(nested)) == 3


def test_a_closed_pipe_stops_the_run_with_a_message_and_status_1(server, tmp_path):
    """`predict photos/ | head -n 1`: the lines that cannot be written stop the run; a message
    and the summary on standard error, no traceback, exit status 1."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for index in range(12):
        shutil.copy(PHOTOS_DIR / "coffee.png", folder / f"coffee-{index:02d}.png")
    script = (f"{sys.executable} -m torchserve_vision predict {folder} --model {DETECTOR} --concurrency 1 "
              f"--inference-url {server.inference_url} --management-url {server.management_url} "
              '| head -n 1; exit "${PIPESTATUS[0]}"')
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert len(result.stdout.splitlines()) == 1 and json.loads(result.stdout)["status"] == 200
    assert "Broken pipe); stopped" in result.stderr and "of 12 images" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
