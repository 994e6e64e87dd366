"""The TorchServe-facing base class: OOM retries, the batch record, metrics, logging."""

from __future__ import annotations

import json
import logging
import os
import time

import psutil
import pytest
import torch
from torch import nn

from handlers import torchserve_context
from handlers.batch.batch_record import BatchRecord
from handlers.batch_metrics import emit_batch_metrics
from handlers.image_classifier import ImageClassifierHandler
from tests.answers import assert_same_answer
from tests.archives import archive_context, process_threads_kept
from tests.images import photo_bytes
from tests.recording_metrics import RecordingMetrics
from torchserve_vision.local_handler import LocalContext

PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]


class OutOfMemoryAbove(nn.Module):
    """Wraps a model; raises CUDA's out-of-memory error for batches larger than `limit`."""

    def __init__(self, model: nn.Module, limit: int) -> None:
        super().__init__()
        self.model, self.limit = model, limit
        self.batch_sizes: list[int] = []

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(batch.shape[0])
        if batch.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.model(batch)


def answers(handler: ImageClassifierHandler, rows: list[dict]) -> tuple[list, LocalContext]:
    context = archive_context(handler.model_dir)
    return [json.loads(body) for body in handler.handle(rows, context)], context


def test_out_of_memory_splits_the_batch_and_every_request_still_gets_its_answer(tiny_classifier,
                                                                                monkeypatch):
    rows = [{"body": bytearray(photo_bytes(name))} for name in PHOTOS]
    expected = [answers(tiny_classifier, [row])[0][0] for row in rows]
    assert len({answer[0]["index"] for answer in expected}) == len(PHOTOS)  # a mix-up would show
    wrapper = OutOfMemoryAbove(tiny_classifier.model, limit=2)
    monkeypatch.setattr(tiny_classifier, "model", wrapper)
    served, context = answers(tiny_classifier, rows)
    assert [context.status(i) for i in range(5)] == [200] * 5
    for got, want in zip(served, expected, strict=True):
        assert [c["index"] for c in got] == [c["index"] for c in want]
    assert wrapper.batch_sizes == [5, 2, 3, 1, 2]  # 5 fails -> 2 fits, 3 fails -> 1 + 2 fit


def test_a_single_request_that_does_not_fit_is_a_server_fault(tiny_classifier, monkeypatch):
    monkeypatch.setattr(tiny_classifier, "model", OutOfMemoryAbove(tiny_classifier.model, limit=0))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        answers(tiny_classifier, [{"body": bytearray(photo_bytes("coffee.png"))}])


def test_one_structured_log_line_per_batch(tiny_classifier, caplog):
    rows = [{"body": bytearray(photo_bytes("coffee.png"))}, {"body": bytearray(b"junk")}]
    with caplog.at_level(logging.INFO, logger="handlers.serving"):
        answers(tiny_classifier, rows)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch ")]
    record = json.loads(line.removeprefix("batch "))
    assert (record["model"], record["version"], record["size"], record["answered"]) == (
        "tiny", "1.0", 2, 1)
    assert record["rejected"] == {"NotAnImage": 1}
    assert record["stage_ms"]["inference"] > 0
    assert record["batch_ms"] >= sum(record["stage_ms"].values()) - 0.05   # rounded to 0.01 each


def test_a_batch_line_says_how_long_the_worker_waited_since_its_previous_answers(tiny_classifier, caplog):
    row = {"body": bytearray(photo_bytes("coffee.png"))}
    answers(tiny_classifier, [row])
    answered = tiny_classifier.last_batch_answered
    with caplog.at_level(logging.INFO, logger="handlers.serving"):
        answers(tiny_classifier, [row])
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch ")]
    record = json.loads(line.removeprefix("batch "))
    assert answered is not None and record["waited_ms"] > 0
    assert tiny_classifier.last_batch_answered > answered


def test_batch_logging_can_be_turned_off(tiny_classifier, caplog, monkeypatch):
    monkeypatch.setattr(tiny_classifier, "log_batches", False)
    with caplog.at_level(logging.INFO, logger="handlers.serving"):
        answers(tiny_classifier, [{"body": bytearray(photo_bytes("coffee.png"))}])
    assert not [r for r in caplog.records if r.getMessage().startswith("batch ")]


def test_payloads_never_reach_the_log(tiny_classifier, caplog):
    marker = b"PRIVATE-PAYLOAD-7f3a9c"
    with caplog.at_level(logging.DEBUG):
        answers(tiny_classifier, [{"body": bytearray(marker)}, {"body": {"data": "UFJJVkFURQ=="}}])
    assert "PRIVATE-PAYLOAD" not in caplog.text and "UFJJVkFURQ" not in caplog.text


def test_metrics_carry_batch_size_stage_times_and_rejections_by_reason():
    record = BatchRecord("m", "1", size=3, answered=1)
    record.rejected.update(["NotAnImage", "NotAnImage"])
    record.stage_ms.update(decode=1.5, inference=20.0)
    metrics = RecordingMetrics()
    emit_batch_metrics(metrics, record)
    values = {(name, tuple(dims.items())): value for name, value, dims in metrics.calls}
    assert values[("HandlerBatchSize", ())] == 3
    assert values[("HandlerRequests", ())] == 3 and values[("HandlerBatches", ())] == 1
    assert values[("HandlerDecodeMs", ())] == 1.5 and values[("HandlerInferenceMs", ())] == 20.0
    assert values[("HandlerRejectedRequests", (("Reason", "NotAnImage"),))] == 2


def test_the_batch_line_says_when_the_batch_began_by_the_workers_clock():
    before = time.time()
    record = BatchRecord("m", "1", size=2, answered=2)
    after = time.time()
    record.finish()
    line = record.to_log_line()
    assert line.startswith("batch {")
    logged = json.loads(line.removeprefix("batch "))
    assert before - 1e-6 <= logged["started_at"] <= after + 1e-6
    assert (logged["model"], logged["version"], logged["size"]) == ("m", "1", 2)


def test_describe_names_the_server_a_worker_belongs_to_by_its_parent_process(tiny_classifier):
    frontend = tiny_classifier.describe()["frontend"]
    parent = psutil.Process().parent()
    assert frontend["pid"] == os.getppid() == parent.pid
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(parent.create_time()))
    assert frontend["started"] == started


def test_request_headers_are_read_in_any_case(tiny_classifier):
    """HTTP/2 clients and proxies such as HAProxy and Envoy send header names in lower case;
    TorchServe hands them to the handler as sent."""
    image = photo_bytes("chelsea.png")
    spellings = [{"X-Top-K": "2"}, {"x-top-k": "2"}, {"X-TOP-K": "2"}]
    context = archive_context(tiny_classifier.model_dir, request_headers=spellings)
    served = [json.loads(body) for body in
              tiny_classifier.handle([{"body": bytearray(image)} for _ in spellings], context)]
    assert [len(answer) for answer in served] == [2, 2, 2]
    for answer in served[1:]:    # one image; batch positions may sum in another order (AVX2 GEMM)
        assert_same_answer(answer, served[0])


class FakeProcess:
    """psutil.Process() of a worker whose parent (the frontend) ran `cmdline`."""

    def __init__(self, cmdline: list[str]) -> None:
        self.arguments = cmdline

    def parent(self) -> FakeProcess:
        return self

    def cmdline(self) -> list[str]:
        return self.arguments

    pid = 1

    def create_time(self) -> float:
        return 0.0


@pytest.mark.parametrize(("queued", "frontend", "agent", "says"), [
    (True, ["java", "-javaagent:/x/build/frontend-agent-0123abcd.jar", "-cp", "m.jar"], True, "agent's"),
    (True, ["java", "-cp", "model-server.jar"], False, "not loaded"),
    (True, ["java", "-javaagent:/opt/other-agent.jar"], False, "not loaded"),
    (False, ["java", "-cp", "model-server.jar"], False, "TorchServe's batch aggregator"),
])
def test_a_worker_says_how_its_batches_are_gathered(queued, frontend, agent, says, monkeypatch):
    monkeypatch.setattr(torchserve_context.psutil, "Process", lambda: FakeProcess(frontend))
    account = torchserve_context.batching_account({"continuousBatching": True} if queued else {})
    assert account["asked"] == ("queued" if queued else "delayed")
    assert account["frontend_agent"] is agent and says in account["gathered_by"]


def test_queued_batching_without_the_agent_is_logged_and_described(tiny_classifier, monkeypatch, caplog):
    monkeypatch.setattr(torchserve_context.psutil, "Process", lambda: FakeProcess(["java", "-cp", "m.jar"]))
    context = archive_context(tiny_classifier.model_dir)
    context.model_yaml_config = {**(context.model_yaml_config or {}), "continuousBatching": True}
    handler = type(tiny_classifier)()
    with caplog.at_level(logging.WARNING, logger="handlers.serving"), process_threads_kept():
        handler.initialize(context)
    assert any("without the frontend agent" in record.getMessage() for record in caplog.records)
    assert handler.describe()["batching"]["frontend_agent"] is False
