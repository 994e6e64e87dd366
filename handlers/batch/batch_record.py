"""What happened to one batch: sizes, rejections by reason, time per stage. Logged and exported."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from handlers.ground.profiler_ranges import profiled_range

STAGES = ("cache", "decode", "preprocess", "inference", "postprocess")


@dataclass
class BatchRecord:
    model: str
    version: str
    size: int = 0
    answered: int = 0
    rejected: Counter[str] = field(default_factory=Counter)   # error type -> count
    stage_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    oom_splits: int = 0
    runner: str = "eager"   # else the compiled runner(s) that ran the batch, e.g. "openvino-bf16"
    # What a handler adds (see BatchedImageHandler.record_answers): counters are summed over
    # batches (e.g. EscalatedRequests), gauges hold this batch's value (e.g. EscalationRate).
    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    # Where a worker's time goes besides the stages: the batch from its start to this record's
    # log line (`finish`), and the wait since the worker's previous batch was answered
    # (TorchServe's protocol both ways and the frontend forming this batch; None for the first).
    batch_ms: float = 0.0
    waited_ms: float | None = None
    # When the batch began, in seconds since the epoch, from the worker's own clock: log4j's
    # timestamp on the line is when the frontend copied it from the worker's stdout, later.
    started_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter, repr=False)

    def finish(self) -> None:
        """The batch's wall time so far, into `batch_ms`."""
        self.batch_ms = (time.perf_counter() - self.started) * 1000

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        """Add the time spent inside the block to `stage` (blocks may repeat: OOM retries). Under
        torch.profiler the block is the range `stage:<stage>`, so that the GPU time of the
        kernels it launches is counted where they were launched (`lab gpu`'s syncs step)."""
        started = time.perf_counter()
        try:
            with profiled_range(f"stage:{stage}"):
                yield
        finally:
            self.stage_ms[stage] += (time.perf_counter() - started) * 1000

    def to_log_line(self) -> str:
        """`batch {json}`: one line per batch, machine-readable."""
        record = asdict(self)
        del record["started"]
        record["rejected"] = dict(self.rejected)
        record["stage_ms"] = {stage: round(ms, 2) for stage, ms in self.stage_ms.items()}
        record["batch_ms"] = round(self.batch_ms, 2)
        record["started_at"] = round(self.started_at, 6)
        if self.waited_ms is not None:
            record["waited_ms"] = round(self.waited_ms, 2)
        return "batch " + json.dumps(record, sort_keys=True)
