"""The in-worker continuous batcher: no waiting when idle, whatever has queued when busy, a
bounded queue, one result per request in order, a failing batch fails only its own requests."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from handlers.continuous_batching import ContinuousBatcher, QueueFull


class GatedModel:
    """Runs batches only when let through, and records each batch."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Semaphore(0)
        self.started = threading.Event()

    def __call__(self, requests: Sequence[int]) -> list[int]:
        self.started.set()
        self.gate.acquire()
        self.batches.append(list(requests))
        if -1 in requests:
            raise RuntimeError("a server fault")
        return [request * 10 for request in requests]


def test_a_lone_request_runs_at_once_without_waiting_for_company():
    def plus_one(requests: Sequence[int]) -> list[int]:
        return [request + 1 for request in requests]

    batcher: ContinuousBatcher[int, int] = ContinuousBatcher(plus_one, 8, 16)
    assert batcher.submit(1).result(timeout=30) == 2
    batcher.close()


def test_requests_that_queue_behind_a_running_batch_form_the_next_batch_in_order():
    model = GatedModel()
    batcher = ContinuousBatcher(model, max_batch_size=4, max_queued=16)
    first = batcher.submit(0)
    assert model.started.wait(30)                         # batch [0] is running
    later = [batcher.submit(value) for value in range(1, 7)]
    assert batcher.queued == 6 and batcher.in_flight == 7
    for _ in range(3):
        model.gate.release()
    assert first.result(timeout=30) == 0
    assert [future.result(timeout=30) for future in later] == [10, 20, 30, 40, 50, 60]
    assert model.batches == [[0], [1, 2, 3, 4], [5, 6]]   # at most 4, arrival order
    batcher.close()


def test_a_full_queue_refuses_at_once():
    model = GatedModel()
    batcher = ContinuousBatcher(model, max_batch_size=2, max_queued=2)
    running = batcher.submit(0)
    assert model.started.wait(30)
    waiting = [batcher.submit(1), batcher.submit(2)]
    with pytest.raises(QueueFull):
        batcher.submit(3)
    for _ in range(2):
        model.gate.release()
    assert [f.result(timeout=30) for f in (running, *waiting)] == [0, 10, 20]
    batcher.close()


def test_a_failing_batch_fails_its_own_requests_only():
    model = GatedModel()
    batcher = ContinuousBatcher(model, max_batch_size=2, max_queued=8)
    blocked = batcher.submit(5)
    assert model.started.wait(30)
    bad = [batcher.submit(-1), batcher.submit(1)]
    after = batcher.submit(2)
    for _ in range(3):
        model.gate.release()
    assert blocked.result(timeout=30) == 50
    for future in bad:
        with pytest.raises(RuntimeError, match="a server fault"):
            future.result(timeout=30)
    assert after.result(timeout=30) == 20
    batcher.close()


def test_close_runs_what_is_queued_then_refuses():
    batcher: ContinuousBatcher[int, int] = ContinuousBatcher(list, 4, 8)
    futures = [batcher.submit(value) for value in range(5)]
    batcher.close()
    assert [future.result(timeout=0) for future in futures] == list(range(5))
    with pytest.raises(RuntimeError):
        batcher.submit(9)
