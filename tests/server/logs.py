"""Reading a test server's log files. The project's log4j2 config writes them from a background
thread, so a line can appear a little after the response that caused it: wait for it. It also
rolls each file over at midnight (`model_log.27-Nov.log.gz`), so a log is read with the files it
rolled over into, oldest first."""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Callable
from pathlib import Path

from torchserve_vision.waiting import wait_until


def rolled_over(path: Path) -> list[Path]:
    """The files log4j2 rolled `path` over into (`<stem>.<date>.log[.gz]`), oldest first."""
    files = [candidate for candidate in path.parent.glob(f"{path.stem}.*{path.suffix}*")
             if candidate != path and candidate.is_file()]
    # while one is being compressed, both `x.log` and `x.log.gz` exist: the first is whole
    files = [candidate for candidate in files
             if not (candidate.suffix == ".gz" and candidate.with_suffix("") in files)]
    return sorted(files, key=lambda candidate: (candidate.stat().st_mtime, candidate.name))


def file_lines(path: Path) -> list[str]:
    """One file's lines; [] for a file that is gone or still being compressed."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError):
        return []
    return data.decode(errors="replace").splitlines()


def log_lines(path: Path) -> list[str]:
    """Every line the server wrote to the log `path`, those of its rolled-over files first."""
    return [line for log in [*rolled_over(path), path] for line in file_lines(log)]


def wait_for_log(path: Path, ready: Callable[[list[str]], bool], timeout_s: float = 10.0,
                 poll_s: float = 0.05) -> list[str]:
    """The log's lines once `ready(lines)` holds, or as they are after `timeout_s` (read every
    `poll_s`)."""
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: ready(log_lines(path)), timeout_s, f"lines in {path}", interval_s=poll_s)
    return log_lines(path)


def batch_records(model_log_lines: list[str], since: float = 0.0) -> list[dict]:
    """The handlers' `batch {json}` records, all models, of the batches begun at `since`
    (time.time(), the worker's clock) or later: a test takes `since` before it sends, so no batch
    of an earlier test is counted, however late the frontend copies that batch's line."""
    records = [json.loads(line.split("batch ", 1)[1]) for line in model_log_lines
               if " batch {" in line or line.startswith("batch {")]
    return [record for record in records if record["started_at"] >= since]


def rejected_requests(model_log_lines: list[str], since: float = 0.0) -> int:
    """Requests the handlers' `batch {json}` lines report as rejected (4xx), all models, in
    batches begun at `since` or later."""
    return sum(sum(record["rejected"].values()) for record in batch_records(model_log_lines, since))
