"""`predict`'s run over real HTTP (a small local server answering as scripted): every image
accounted for (a failure while handling one is its own line, a line that cannot be written stops
the run and counts what was not sent), 503s sent again after Retry-After or a growing backoff,
the answers file read for --resume before a byte of it changes, drawings complete before their
line, and the default concurrency within what the model holds."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from tests.images import PHOTOS_DIR
from torchserve_vision import batch_predict
from torchserve_vision.batch_predict import (
    AnswerLog,
    PredictError,
    PredictionLine,
    PredictionRun,
    ServedModel,
    answered_paths,
    retry_wait_s,
)
from torchserve_vision.client import TorchServeClient
from torchserve_vision.image_inputs import ImageInput


class ScriptedServer(ThreadingHTTPServer):
    """Answers POSTs by the body's text: `busy:N` gets 503 (with Retry-After 0 when the server's
    `retry_after` is set) for its first N requests, then 200; anything else 200. Records when
    each request came."""

    daemon_threads = True

    def __init__(self, retry_after: bool) -> None:
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.retry_after = retry_after
        self.seen: dict[str, list[float]] = {}
        self.lock = threading.Lock()


class ScriptedHandler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        with self.server.lock:
            times = self.server.seen.setdefault(body, [])
            times.append(time.monotonic())
            count = len(times)
        if body.startswith("busy:") and count <= int(body.split(":")[1]):
            payload = b'{"code": 503, "type": "ServiceUnavailableException", "message": "queue full"}'
            self.send_response(503)
            if self.server.retry_after:
                self.send_header("Retry-After", "0")
        else:
            payload = json.dumps([{"label": body, "index": 0, "probability": 1.0}]).encode()
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(params=[True, False], ids=["retry-after", "no-retry-after"])
def server(request) -> Iterator[ScriptedServer]:
    yield from serving(request.param)


@pytest.fixture
def plain_server() -> Iterator[ScriptedServer]:
    yield from serving(True)


def serving(retry_after: bool) -> Iterator[ScriptedServer]:
    scripted = ScriptedServer(retry_after=retry_after)
    thread = threading.Thread(target=scripted.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield scripted
    scripted.shutdown()
    scripted.server_close()


def images(tmp_path: Path, *bodies: str) -> list[ImageInput]:
    found = []
    for index, body in enumerate(bodies):
        path = tmp_path / f"{index:02d}.jpg"
        path.write_text(body)
        found.append(ImageInput(path.resolve(), Path(path.name)))
    return found


def prediction(server: ScriptedServer, concurrency: int = 3) -> PredictionRun:
    url = f"http://127.0.0.1:{server.server_address[1]}/predictions/m"
    return PredictionRun(TorchServeClient(inference_url=url), url, {}, concurrency, timeout_s=10)


def test_a_503_is_sent_again_after_retry_after_or_a_growing_backoff(server, tmp_path, monkeypatch):
    monkeypatch.setattr(batch_predict, "FIRST_BACKOFF_S", 0.01)       # 0.01, 0.02, ... 0.16 s
    lines: list[PredictionLine] = []
    run = prediction(server)
    counts = run.run(images(tmp_path, "busy:3", "plain", "busy:99"), lines.append)
    by_body = {Path(line.path).read_text(): line for line in lines}
    assert by_body["busy:3"].status == 200 and by_body["plain"].status == 200
    assert by_body["busy:99"].status == 503           # still full after every try: its failed line
    assert len(server.seen["busy:99"]) == batch_predict.MAX_503_RETRIES + 1
    assert (counts.answered, counts.failed, counts.not_done) == (2, 1, 0)
    assert counts.retried == 3 + batch_predict.MAX_503_RETRIES
    sent = server.seen["busy:99"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent)]
    if not server.retry_after:      # each wait at least its backoff (2 ms for the timer's grain)
        assert all(gap >= retry_wait_s(None, attempt) - 0.002 for attempt, gap in enumerate(gaps)), gaps


def test_retry_waits_follow_the_header_and_are_bounded():
    assert retry_wait_s(3.0, 0) == 3.0 and retry_wait_s(3600.0, 0) == batch_predict.MAX_RETRY_WAIT_S
    assert [retry_wait_s(None, attempt) for attempt in range(5)] == [0.1, 0.2, 0.4, 0.8, 1.6]


def test_a_failure_while_handling_one_image_is_its_line_and_the_others_go_on(plain_server, tmp_path):
    server = plain_server
    lines: list[PredictionLine] = []

    def complete(image: ImageInput, line: PredictionLine) -> None:
        if image.path.read_text() == "undrawable":
            raise OSError(28, "No space left on device")

    given = images(tmp_path, "a", "undrawable", "b", "c")
    given.append(ImageInput(tmp_path / "gone.jpg", Path("gone.jpg")))         # cannot be read
    counts = prediction(server).run(given, lines.append, complete)
    assert (counts.answered, counts.failed, counts.not_done) == (3, 2, 0)
    failed = {Path(line.path).name: line for line in lines if not line.ok}
    assert failed["01.jpg"].status == 200 and failed["01.jpg"].answer        # answered, not drawn
    assert "No space left on device" in failed["01.jpg"].error["message"]
    assert json.loads(failed["01.jpg"].to_json())["error"]["message"] == failed["01.jpg"].error["message"]
    assert failed["gone.jpg"].status == 0 and "cannot read the file" in failed["gone.jpg"].error["message"]
    assert sorted(Path(line.path).name for line in lines) == [
        "00.jpg", "01.jpg", "02.jpg", "03.jpg", "gone.jpg"]


def test_a_line_that_cannot_be_written_stops_the_run_and_counts_the_rest(plain_server, tmp_path):
    server = plain_server
    written: list[PredictionLine] = []

    def sink(line: PredictionLine) -> None:
        if len(written) == 2:
            raise BrokenPipeError(32, "Broken pipe")
        written.append(line)

    run = prediction(server, concurrency=1)
    with pytest.raises(PredictError, match=r"cannot write the answer line of .*Broken pipe") as raised:
        run.run(images(tmp_path, *[f"photo {index}" for index in range(8)]), sink)
    assert isinstance(raised.value.__cause__, BrokenPipeError)
    assert (run.counts.answered, run.counts.failed, run.counts.not_done) == (2, 0, 6)
    assert len(server.seen) == 3                  # nothing sent after the line that failed
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("predict")]


def test_resume_reads_the_last_line_of_each_path_and_refuses_other_files(tmp_path):
    out = tmp_path / "answers.jsonl"
    lines = [{"path": "/a.jpg", "status": 200, "latency_ms": 1, "answer": []},
             {"path": "/b.jpg", "status": 503, "latency_ms": 1, "error": {}},
             {"path": "/b.jpg", "status": 200, "latency_ms": 1, "answer": []},       # retried: answered
             {"path": "/a.jpg", "status": 200, "latency_ms": 1, "answer": [],
              "error": {"message": "not drawn"}},
             {"path": "/c.jpg", "status": 200, "latency_ms": 1, "answer": []}]
    out.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"path": "/d.j')
    assert answered_paths(out) == {"/b.jpg", "/c.jpg"}
    assert out.read_text().endswith("}\n")          # the partial line cut
    notes = tmp_path / "notes.txt"
    for text in ("shopping\nmilk", '{"path": "/a.jpg", "status": 200}\nmilk', "a note\n"):
        notes.write_text(text)
        with pytest.raises(PredictError, match=r"answers file|not an answer line"):
            answered_paths(notes)
        assert notes.read_text() == text            # not a byte changed


def test_the_default_concurrency_is_what_the_model_holds():
    assert ServedModel("1.0", 2, 4).default_concurrency() == 16               # no queue size known
    assert ServedModel("1.0", 2, 4, queue_size=100).default_concurrency() == 16
    assert ServedModel("1.0", 2, 4, queue_size=2).default_concurrency() == 2 + 2 * 4
    assert ServedModel(None, None, None).default_concurrency() == batch_predict.DEFAULT_CONCURRENCY
    assert batch_predict.queue_size({"jobQueueStatus": {"remainingCapacity": 5, "pendingRequests": 3}}) == 8


def test_answer_log_writes_whole_lines_or_through_the_progress_bar(tmp_path):
    line = PredictionLine("/a.jpg", 200, 1.0, answer=[])
    with open(tmp_path / "out.jsonl", "w") as stream:
        AnswerLog(stream).write(line)
    assert (tmp_path / "out.jsonl").read_text() == line.to_json() + "\n"
    through: list[str] = []
    AnswerLog(open(tmp_path / "unused", "w"), through.append).write(line)  # noqa: SIM115
    assert through == [line.to_json()] and (tmp_path / "unused").read_text() == ""


def test_a_drawing_is_complete_or_absent(tmp_path, monkeypatch):
    from torchserve_vision import answer_drawing

    photo = (PHOTOS_DIR / "coffee.png").read_bytes()
    target = tmp_path / "drawn" / "coffee.png"
    answer = [{"label": "cup", "index": 968, "probability": 0.9}]          # a caption: Pillow only
    answer_drawing.save_drawing(photo, answer, target)
    with Image.open(target) as image:
        image.load()
    assert [path.name for path in target.parent.iterdir()] == ["coffee.png"]

    def failing_save(self, file, format=None, **params):   # as a full disk fails mid-write
        file.write(b"\x89PNG partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", failing_save)
    other = tmp_path / "drawn" / "again.png"
    with pytest.raises(OSError, match="No space"):
        answer_drawing.save_drawing(photo, answer, other)
    assert sorted(path.name for path in target.parent.iterdir()) == ["coffee.png"]
