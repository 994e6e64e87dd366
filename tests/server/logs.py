"""Reading a test server's log files. The project's log4j2 config writes them from a background
thread, so a line can appear a little after the response that caused it: wait for it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

from torchserve_vision.waiting import wait_until


def log_lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


def wait_for_log(path: Path, ready: Callable[[list[str]], bool], timeout_s: float = 10.0,
                 poll_s: float = 0.05) -> list[str]:
    """The log's lines once `ready(lines)` holds, or as they are after `timeout_s` (read every
    `poll_s`)."""
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: ready(log_lines(path)), timeout_s, f"lines in {path}", interval_s=poll_s)
    return log_lines(path)


def rejected_requests(model_log_lines: list[str]) -> int:
    """Requests the handlers' `batch {json}` lines report as rejected (4xx), all models."""
    return sum(sum(json.loads(line.split("batch ", 1)[1])["rejected"].values())
               for line in model_log_lines if " batch {" in line or line.startswith("batch {"))
