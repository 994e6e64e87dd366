"""Continuous batching inside the worker: each batch is whatever has arrived, up to a maximum.

With TorchServe's asynchronous worker mode (`asyncCommunication: true` in the archive's YAML)
the frontend hands every request to the worker as soon as it arrives instead of holding it for
`maxBatchDelay` to gather company. This batcher then runs one batch at a time on its own thread:
it waits for the first request, takes every request queued behind it (up to `max_batch_size`)
without waiting for more, and runs them together. An idle worker answers a lone request at once;
a busy one finds a full batch queued when the previous batch ends. The queue is bounded: a
request that finds `max_queued` requests waiting is refused at once (QueueFull), so overload is
shed quickly instead of waiting out its timeout.

Pure: no TorchServe, no torch. `run_batch` gets the queued requests in arrival order and returns
one result per request, in order; if it raises, every request of that batch gets the exception.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

Request = TypeVar("Request")
Result = TypeVar("Result")


class QueueFull(Exception):
    """The batcher already holds `max_queued` waiting requests."""


class ContinuousBatcher(Generic[Request, Result]):
    def __init__(self, run_batch: Callable[[Sequence[Request]], Sequence[Result]],
                 max_batch_size: int, max_queued: int, name: str = "batcher") -> None:
        if max_batch_size < 1 or max_queued < 1:
            raise ValueError(f"max_batch_size ({max_batch_size}) and max_queued ({max_queued}) "
                             "must be at least 1")
        self.run_batch, self.max_batch_size, self.max_queued = run_batch, max_batch_size, max_queued
        self._waiting: deque[tuple[Request, Future[Result]]] = deque()
        self._changed = threading.Condition()
        self._running = 0          # requests of the batch being run
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (not counting the batch being run)."""
        with self._changed:
            return len(self._waiting)

    @property
    def in_flight(self) -> int:
        """Requests waiting or being run."""
        with self._changed:
            return len(self._waiting) + self._running

    def submit(self, request: Request) -> Future[Result]:
        """Queue `request`; its result (or the batch's exception) comes in the future. QueueFull
        when `max_queued` requests are already waiting; RuntimeError after `close`."""
        future: Future[Result] = Future()
        with self._changed:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            if len(self._waiting) >= self.max_queued:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append((request, future))
            self._changed.notify()
        return future

    def close(self) -> None:
        """Stop after the requests already queued have been run."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _next_batch(self) -> list[tuple[Request, Future[Result]]] | None:
        with self._changed:
            while not self._waiting and not self._closed:
                self._changed.wait()
            if not self._waiting:
                return None
            count = min(len(self._waiting), self.max_batch_size)
            batch = [self._waiting.popleft() for _ in range(count)]
            self._running = count
            return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                results = self.run_batch([request for request, _ in batch])
                if len(results) != len(batch):
                    raise ValueError(f"{len(results)} results for {len(batch)} requests")
            except BaseException as error:  # noqa: BLE001 - every request of the batch learns of it
                for _, future in batch:
                    future.set_exception(error)
            else:
                for (_, future), result in zip(batch, results, strict=True):
                    future.set_result(result)
            with self._changed:
                self._running = 0
