"""A stand-in for TorchServe's metrics cache that records what handlers emit."""

from __future__ import annotations

from typing import Any


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict]] = []
        self.counters: list[tuple[str, float, dict]] = []

    def add_metric(self, name: str, value: float, unit: str, idx: Any = None, dimensions: Any = (),
                   metric_type: Any = None) -> None:
        self.calls.append((name, value, {d.name: d.value for d in dimensions}))

    def add_counter(self, name: str, value: float, idx: Any = None, dimensions: Any = ()) -> None:
        self.calls.append((name, value, {d.name: d.value for d in dimensions}))
        self.counters.append(self.calls[-1])

    def counters_of(self, *names: str) -> list[tuple[str, float, dict]]:
        """The counters named `names`, in order (a worker also makes its drift counters at start)."""
        return [counter for counter in self.counters if counter[0] in names]
