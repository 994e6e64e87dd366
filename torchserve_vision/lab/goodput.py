"""Goodput under overload: answers that reach the client while it still waits, per second.

Capacity is measured first (closed loop, 16 clients). Then, for each load (a multiple of
capacity), open-loop Poisson arrivals whose client gives up after `timeout_ms`, in turn: without
deadlines, and with the client's timeout sent as its deadline (X-Request-Timeout-Ms), which the
frontend agent answers with 504 for a request that can no longer be answered in time; with
`high_share`, a third run with deadlines sends that share of the requests with
`X-Request-Priority: high` (two generators side by side), reported per priority. Between runs
the model's queue is left to empty, so that one run's leftovers do not load the next (and after
a run with priorities, the workers' memory of high-priority requests runs out). Each row
says how much CPU the load generator itself took: on a small machine it competes with the
workers, and at three times capacity that is part of the gap to capacity.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchserve_vision.lab import loadgen

DEADLINE_HEADER = "X-Request-Timeout-Ms"
PRIORITY_HEADER = "X-Request-Priority"
CAPACITY_CLIENTS = 16
MAX_IN_FLIGHT = 512
# The frontend agent keeps room for high-priority requests for 10 s after the last one: a run
# after one with priorities waits that out, or its queue would be kept half empty.
PRIORITY_MEMORY_S = 10.0


@dataclass(frozen=True)
class GoodputRow:
    """One open-loop run, or one priority's part of it. `goodput_rps`: answers (200) within the
    client's timeout per second; `late`: answers after it (the client had gone); `timed_out`: no
    answer in time; `client_cpu`: the load generator's CPU time over the run's wall time (cores)."""

    setting: str       # "no deadline", "deadline", "deadline, high", "deadline, normal"
    load: float
    offered_rps: float
    sent: int
    goodput_rps: float
    late: int
    shed: int          # 503: the queue was full, or room was kept for high priority
    expired: int       # 504: the deadline ran out in the queue
    timed_out: int
    other_errors: int
    useful_p99_ms: float
    client_cpu: float = 0.0

    def line(self, capacity_rps: float) -> str:
        return (f"{self.setting:16} {self.load:3.1f}x  offered {self.offered_rps:6.1f}/s  "
                f"goodput {self.goodput_rps:6.1f}/s ({self.goodput_rps / capacity_rps:4.2f} of "
                f"capacity)  p99 useful {self.useful_p99_ms:4.0f} ms  sent {self.sent}: shed "
                f"{self.shed}, expired {self.expired}, timed out {self.timed_out}, late "
                f"{self.late}, other {self.other_errors}  client CPU {self.client_cpu:.2f} cores")


def goodput_row(results: Sequence[loadgen.Result], timeout_ms: float, duration_s: float,
                setting: str, load: float, offered_rps: float, client_cpu: float = 0.0) -> GoodputRow:
    """The row of one run's results (latencies from each request's scheduled time)."""
    answered = [r.latency_ms for r in results if r.status == 200]
    useful = [latency for latency in answered if latency <= timeout_ms]
    known = (200, 503, 504, 0)
    return GoodputRow(
        setting=setting, load=load, offered_rps=offered_rps, sent=len(results),
        goodput_rps=len(useful) / duration_s, late=len(answered) - len(useful),
        shed=sum(r.status == 503 for r in results), expired=sum(r.status == 504 for r in results),
        timed_out=sum(r.status == 0 for r in results),
        other_errors=sum(r.status not in known for r in results),
        useful_p99_ms=loadgen.latency_summary(useful)["p99"], client_cpu=client_cpu)


def open_loop_streams(streams: Sequence[tuple[loadgen.LoadTarget, float]], duration_s: float,
                      seed: int) -> tuple[list[list[loadgen.Result]], float]:
    """Open-loop Poisson streams (target, rate) run side by side from one start; (each stream's
    results, the generator's CPU time over the wall time, in cores)."""
    results: list[list[loadgen.Result]] = [[] for _ in streams]
    started = time.perf_counter()
    cpu_start = time.process_time()
    threads = [threading.Thread(target=loadgen.run_open_loop, daemon=True,
                                args=(target, rate, duration_s, 1_000_000),
                                kwargs={"max_in_flight": max(MAX_IN_FLIGHT // len(streams), 1),
                                        "seed": seed + index, "results": results[index],
                                        "started": started})
               for index, (target, rate) in enumerate(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu_cores = (time.process_time() - cpu_start) / (time.perf_counter() - started)
    return results, cpu_cores


def with_headers(target: loadgen.LoadTarget, headers: dict[str, str],
                 timeout_ms: float) -> loadgen.LoadTarget:
    return loadgen.LoadTarget(target.url, target.bodies, {**target.headers, **headers},
                              timeout_s=timeout_ms / 1000)


def runs_at(target: loadgen.LoadTarget, timeout_ms: float, load: float, capacity_rps: float,
            duration_s: float, seed: int, high_share: float, drain: Callable[[], None]) -> list[GoodputRow]:
    """The rows of one load: without deadlines, with them, and with them and priorities, the
    queue drained after each run."""
    offered = load * capacity_rps
    deadline = {DEADLINE_HEADER: str(int(timeout_ms))}
    # Each run: its streams (row name, headers, share of the load), sent side by side.
    runs: list[list[tuple[str, dict[str, str], float]]] = [
        [("no deadline", {}, 1.0)], [("deadline", deadline, 1.0)]]
    if high_share > 0:
        runs.append([("deadline, high", {**deadline, PRIORITY_HEADER: "high"}, high_share),
                     ("deadline, normal", {**deadline, PRIORITY_HEADER: "normal"}, 1.0 - high_share)])
    rows: list[GoodputRow] = []
    for streams in runs:
        results, cpu = open_loop_streams(
            [(with_headers(target, headers, timeout_ms), offered * share) for _, headers, share in streams],
            duration_s, seed)
        rows.extend(goodput_row(stream_results, timeout_ms, duration_s, name, load, offered * share, cpu)
                    for (name, _, share), stream_results in zip(streams, results, strict=True))
        drain()
        if any(PRIORITY_HEADER in headers for _, headers, _ in streams):
            time.sleep(PRIORITY_MEMORY_S)
    return rows


def measure_goodput(target: loadgen.LoadTarget, timeout_ms: float, loads: Sequence[float],
                    duration_s: float, drain: Callable[[], None], seed: int = 0,
                    high_share: float = 0.0) -> tuple[float, list[GoodputRow]]:
    """(capacity in requests/s, the rows of every load, its settings interleaved)."""
    if not 0.0 <= high_share < 1.0:
        raise ValueError(f"--high-share must be at least 0 and below 1, got {high_share}")
    loadgen.run_closed_loop(target, CAPACITY_CLIENTS, min(duration_s, 3.0), 1_000_000)   # warm up
    capacity = loadgen.run_closed_loop(target, CAPACITY_CLIENTS, duration_s, 1_000_000).throughput_rps
    drain()
    rows: list[GoodputRow] = []
    for load in loads:
        rows.extend(runs_at(target, timeout_ms, load, capacity, duration_s, seed, high_share, drain))
    return capacity, rows
