"""Pure parts of torchserve_vision/server_process.py (the real-server behaviour is tested under
tests/server/)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

from torchserve_vision.server_process import ServerError, instance_for, start, stop_handler


class NestedSignalEvent(threading.Event):
    """An event whose `set()` is interrupted, while it holds its lock, by the same signal
    again (what Python does when a second SIGTERM arrives during the first handler)."""

    def __init__(self) -> None:
        super().__init__()
        self.handler: Callable[[int, Any], None] | None = None
        self.nested = 0
        self.lock = threading.Lock()          # as the real set() holds its condition's lock

    def set(self) -> None:
        with self.lock:
            if self.nested == 0:
                self.nested += 1
                assert self.handler is not None
                self.handler(signal.SIGTERM, None)   # would wait for this lock forever if it set()
            super().set()


def test_a_second_signal_during_the_first_never_waits_for_the_events_lock():
    event = NestedSignalEvent()
    handler = stop_handler(event)
    event.handler = handler
    finished = threading.Event()

    def first_signal() -> None:
        handler(signal.SIGTERM, None)
        finished.set()
    threading.Thread(target=first_signal, daemon=True).start()
    assert finished.wait(10), "the nested signal waited for the event's lock"
    assert event.is_set() and event.nested == 1


def test_two_real_signals_set_the_stop_event():
    stop = threading.Event()
    previous = signal.signal(signal.SIGUSR1, stop_handler(stop))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.wait(5)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_start_names_the_archives_the_store_lacks_before_starting_anything(tmp_path):
    config = tmp_path / "config.properties"
    config.write_text("inference_address=http://127.0.0.1:1\nmanagement_address=http://127.0.0.1:2\n"
                      "metrics_address=http://127.0.0.1:3\nload_models=present.mar,absent-1.0.mar\n")
    store = tmp_path / "store"
    store.mkdir()
    (store / "present.mar").write_bytes(b"")
    instance = instance_for(config, tmp_path / "run")
    with pytest.raises(ServerError, match=r"lacks absent-1\.0\.mar .*torchserve-vision build"):
        start(instance, store, timeout_s=1)
    assert not (tmp_path / "run" / "torchserve.out").exists()    # TorchServe was never started
