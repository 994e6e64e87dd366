"""Continuous load for real-server tests: clients send real images until stopped, back to back
or pacing themselves."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests

from torchserve_vision.waiting import wait_until


@dataclass(frozen=True)
class Outcome:
    sent_at: float
    received_at: float
    status: int          # 0 for a connection error or timeout
    body: Any
    model_version: str | None = None   # the answer's X-Model-Version


# The pause for a load whose point is that no request fails while something changes: about a
# dozen requests a second from three or four clients, the rest of the CPU left to the change.
CHANGE_PAUSE_S = 0.25


@dataclass
class ContinuousLoad:
    """`clients` threads POSTing `image` to `url`, each on a keep-alive connection, each waiting
    `pause_s` after every answer (0: back to back, which keeps every worker busy).

    A test whose point is that no request fails while something changes needs requests arriving
    throughout the change, not saturated workers: a pause leaves the CPU to the change itself
    (the new version's worker start), which on a 2-core machine otherwise competes with the
    load for it."""

    url: str
    image: bytes
    clients: int = 4
    headers: Callable[[], dict[str, str]] = dict
    max_seconds: float = 300.0
    pause_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _client(self) -> None:
        session = requests.Session()
        deadline = time.monotonic() + self.max_seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            sent_at = time.monotonic()
            try:
                answer = session.post(self.url, data=self.image, timeout=60, headers={
                    "Content-Type": "application/octet-stream", **self.headers()})
                status, body = answer.status_code, answer.json() if answer.content else None
                version = answer.headers.get("X-Model-Version")
            except (requests.RequestException, ValueError) as error:
                status, body, version = 0, repr(error), None
            with self._lock:
                self.outcomes.append(Outcome(sent_at, time.monotonic(), status, body, version))
            if self.pause_s:
                self._stop.wait(self.pause_s)

    def __enter__(self) -> ContinuousLoad:
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)

    def wait_for(self, count: int, timeout_s: float = 60.0) -> None:
        """Block until at least `count` more answers have arrived (TimeoutError after `timeout_s`)."""
        target = len(self.outcomes) + count
        wait_until(lambda: len(self.outcomes) >= target, timeout_s, f"{count} answers",
                   interval_s=0.05)

    def wait_for_sent_after(self, at: float, count: int, timeout_s: float = 60.0) -> None:
        """Block until `count` answers to requests sent after the monotonic time `at` have
        arrived: the load has been served in the state that began at `at`, however fast the
        machine is."""
        wait_until(lambda: sum(o.sent_at > at for o in list(self.outcomes)) >= count, timeout_s,
                   f"{count} answers to requests sent after {at:.3f}", interval_s=0.05)

    def sent_between(self, start: float, end: float) -> list[Outcome]:
        """The answers to requests sent after `start` and answered before `end`."""
        return [o for o in list(self.outcomes) if o.sent_at > start and o.received_at < end]

    def failures(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if outcome.status != 200]
