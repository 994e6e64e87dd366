"""Goodput under overload: answers that reach the client while it still waits, per second.

Capacity is measured first (closed loop, 16 clients). Then, for each load (a multiple of
capacity), open-loop Poisson arrivals whose client gives up after `timeout_ms`, twice in turn:
without deadlines, and with the client's timeout sent as its deadline (X-Request-Timeout-Ms),
which the frontend agent answers with 504 for a request still queued when it runs out. Between
runs the model's queue is left to empty, so that one run's leftovers do not load the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchserve_vision.lab import loadgen

DEADLINE_HEADER = "X-Request-Timeout-Ms"
CAPACITY_CLIENTS = 16


@dataclass(frozen=True)
class GoodputRow:
    """One open-loop run. `goodput_rps`: answers (200) within the client's timeout per second;
    `late`: answers after it (the client had gone); `timed_out`: no answer in time."""

    deadlines: bool
    load: float
    offered_rps: float
    sent: int
    goodput_rps: float
    late: int
    shed: int          # 503: the queue was full
    expired: int       # 504: the deadline ran out in the queue
    timed_out: int
    other_errors: int
    useful_p99_ms: float

    def line(self, capacity_rps: float) -> str:
        return (f"{'with' if self.deadlines else 'without':7} {self.load:3.1f}x  "
                f"offered {self.offered_rps:6.1f}/s  goodput {self.goodput_rps:6.1f}/s "
                f"({self.goodput_rps / capacity_rps:4.2f} of capacity)  p99 useful "
                f"{self.useful_p99_ms:6.0f} ms  sent {self.sent}: shed {self.shed}, expired "
                f"{self.expired}, timed out {self.timed_out}, late {self.late}")


def goodput_row(results: Sequence[loadgen.Result], timeout_ms: float, duration_s: float,
                deadlines: bool, load: float, offered_rps: float) -> GoodputRow:
    """The row of one run's results (latencies from each request's scheduled time)."""
    answered = [r.latency_ms for r in results if r.status == 200]
    useful = [latency for latency in answered if latency <= timeout_ms]
    known = (200, 503, 504, 0)
    return GoodputRow(
        deadlines=deadlines, load=load, offered_rps=offered_rps, sent=len(results),
        goodput_rps=len(useful) / duration_s, late=len(answered) - len(useful),
        shed=sum(r.status == 503 for r in results), expired=sum(r.status == 504 for r in results),
        timed_out=sum(r.status == 0 for r in results),
        other_errors=sum(r.status not in known for r in results),
        useful_p99_ms=loadgen.latency_summary(useful)["p99"])


def measure_goodput(target: loadgen.LoadTarget, timeout_ms: float, loads: Sequence[float],
                    duration_s: float, drain: Callable[[], None], seed: int = 0
                    ) -> tuple[float, list[GoodputRow]]:
    """(capacity in requests/s, one row per load and deadline setting, interleaved)."""
    loadgen.run_closed_loop(target, CAPACITY_CLIENTS, min(duration_s, 3.0), 1_000_000)   # warm up
    capacity = loadgen.run_closed_loop(target, CAPACITY_CLIENTS, duration_s, 1_000_000).throughput_rps
    drain()
    rows = []
    for load in loads:
        for deadlines in (False, True):
            headers = {**target.headers, **({DEADLINE_HEADER: str(int(timeout_ms))} if deadlines else {})}
            run = loadgen.LoadTarget(target.url, target.bodies, headers, timeout_s=timeout_ms / 1000)
            results: list[loadgen.Result] = []
            offered = load * capacity
            loadgen.run_open_loop(run, offered, duration_s, 1_000_000, max_in_flight=512, seed=seed,
                                  results=results)
            rows.append(goodput_row(results, timeout_ms, duration_s, deadlines, load, offered))
            drain()
    return capacity, rows
