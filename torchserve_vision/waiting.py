"""The one way the command waits for something: poll a condition until it holds or time runs
out. A condition may raise to stop the wait early (a worker died, a process exited)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, *,
               interval_s: float = 0.1, error: Callable[[str], Exception] = TimeoutError,
               cancelled: threading.Event | None = None) -> float:
    """Seconds until `condition()` is true (checked at once, then every `interval_s`); raises
    `error("timed out after N s waiting for <what>")` after `timeout_s`. With `cancelled`, a set
    event ends the wait early (returning the seconds so far): the caller is stopping anyway."""
    started = time.monotonic()
    cancelled = cancelled or threading.Event()
    while not condition():
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise error(f"timed out after {timeout_s:.0f} s waiting for {what}")
        if cancelled.wait(interval_s):
            break
    return time.monotonic() - started
