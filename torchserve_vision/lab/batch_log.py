"""Where served throughput goes: the handlers' `batch {json}` log lines over a time window, set
against the in-process profile of the same archive.

Served throughput = workers x busy x (requests per batch / handler ms per batch). Against the
in-process handler path (full batches, nothing else on the CPU) the ratio splits into three
factors, each measured:

- **busy**: the share of the window the workers spent inside the handler's stages (the rest is
  the frontend forming the batch, the round trip to the worker, serialising answers, waiting for
  clients to send again);
- **batch size**: what the batches served cost per request by the in-process fit t(B), against a
  full batch: smaller batches share the fixed cost among fewer requests;
- **contention**: the in-process fit of the batches served against what they took when served:
  the frontend, the load generator and the other worker share the same cores.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from torchserve_vision.lab.batch_model import BatchTimeFit

LINE = re.compile(r"^(\S+) \[\w+\s*\] W-(\d+)-(\S+?)_([^_\s]+)-stdout MODEL_LOG - batch (\{.*\})$")
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S,%f"


@dataclass(frozen=True)
class LoggedBatch:
    at: datetime
    worker: str
    size: int
    handler_ms: float   # the sum of the handler's stages (cache, decode, ..., postprocess)
    stage_ms: Mapping[str, float] = field(default_factory=dict)   # each stage's ms
    batch_ms: float | None = None      # the batch's wall time in the handler (None: older lines)
    waited_ms: float | None = None     # since the worker's previous batch was answered


def logged_batches(lines: Iterable[str], model: str, version: str) -> list[LoggedBatch]:
    """The batch lines of one model version in TorchServe's model_log.log."""
    batches = []
    for line in lines:
        match = LINE.match(line.rstrip("\n"))
        if match and match[3] == model and match[4] == version:
            record = json.loads(match[5])
            batches.append(LoggedBatch(datetime.strptime(match[1], TIMESTAMP_FORMAT), match[2],
                                       int(record["size"]), sum(record["stage_ms"].values()),
                                       record["stage_ms"], record.get("batch_ms"),
                                       record.get("waited_ms")))
    return batches


def stage_means(batches: Sequence[LoggedBatch]) -> dict[str, Any]:
    """How many batches, their mean size, and each stage's mean ms per batch and per image."""
    if not batches:
        return {"batches": 0}
    images = sum(batch.size for batch in batches)
    stages = {stage for batch in batches for stage in batch.stage_ms}
    totals = {stage: sum(batch.stage_ms.get(stage, 0.0) for batch in batches) for stage in sorted(stages)}
    means = {"batches": len(batches), "mean_batch_size": images / len(batches),
             "ms_per_batch": {stage: total / len(batches) for stage, total in totals.items()},
             "ms_per_image": {stage: total / images for stage, total in totals.items()}}
    timed = [batch for batch in batches if batch.batch_ms is not None]
    if timed:   # the handler's own time outside its stages (parsing answers, metrics, log)
        means["outside_stages_ms_per_batch"] = sum(
            (batch.batch_ms or 0.0) - batch.handler_ms for batch in timed) / len(timed)
    waits = [batch.waited_ms for batch in batches if batch.waited_ms is not None]
    if waits:   # between batches: TorchServe's protocol both ways and the frontend
        means["waited_ms_per_batch"] = sum(waits) / len(waits)
    return means


@dataclass(frozen=True)
class ServedBreakdown:
    batches: int
    requests: int
    window_s: float
    workers: int
    mean_batch_size: float
    batch_sizes: dict[int, int]        # size -> how many batches
    busy: float                        # handler time / (window x workers)
    batch_size_factor: float           # in-process cost per request at full batches / at those served
    contention_factor: float           # in-process fit of the served batches / their served time
    served_over_in_process: float      # the product of the three

    def table(self) -> str:
        sizes = ", ".join(f"{size}: {count}" for size, count in sorted(self.batch_sizes.items()))
        return (f"{self.batches} batches, {self.requests} requests over {self.window_s:.1f} s on "
                f"{self.workers} workers; mean batch {self.mean_batch_size:.2f} ({sizes})\n"
                f"served / in-process {self.served_over_in_process:.2f} = busy {self.busy:.2f} x "
                f"batch size {self.batch_size_factor:.2f} x contention {self.contention_factor:.2f}")


def served_breakdown(batches: list[LoggedBatch], fit: BatchTimeFit, full_batch: int,
                     window_s: float) -> ServedBreakdown:
    """`batches` served within `window_s` seconds against the in-process fit of the handler path.
    ValueError when there are none."""
    if not batches:
        raise ValueError("no batch lines in the window: is log_batches off?")
    workers = len({batch.worker for batch in batches})
    requests = sum(batch.size for batch in batches)
    served_ms = sum(batch.handler_ms for batch in batches)
    fitted_ms = sum(fit.batch_ms(batch.size) for batch in batches)
    busy = served_ms / (window_s * 1000 * workers)
    batch_size_factor = (fit.batch_ms(full_batch) / full_batch) / (fitted_ms / requests)
    contention = fitted_ms / served_ms
    return ServedBreakdown(len(batches), requests, window_s, workers, requests / len(batches),
                           dict(Counter(batch.size for batch in batches)), busy, batch_size_factor,
                           contention, busy * batch_size_factor * contention)
