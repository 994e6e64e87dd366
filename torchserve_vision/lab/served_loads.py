"""One model served by a TorchServe of its own, measured by closed-loop clients sending JPEGs at
several loads: the served side of the labs that set the project beside what a user would run
instead (lab ultralytics, lab opencv)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchserve_vision.lab.loadgen import LoadTarget, run_closed_loop
from torchserve_vision.server_process import instance_for, start, stop

WARM_UP_S = 3.0


def served_loads(config: Path, store: Path, model: str, jpegs: Sequence[bytes], clients: Sequence[int],
                 duration_s: float, run_dir: Path) -> dict[int, dict[str, Any]]:
    """TorchServe started from `config` and `store` in `run_dir`, warmed up at the most clients,
    then `model` at each number of `clients` for `duration_s`: images/s, p50 ms and errors by
    load; the server stopped again."""
    instance = instance_for(config, run_dir)
    start(instance, store, timeout_s=600)
    try:
        target = LoadTarget(f"{instance.inference_url}/predictions/{model}", list(jpegs),
                            {"Content-Type": "image/jpeg"})
        run_closed_loop(target, max(clients), WARM_UP_S, 10**6)
        by_load = {}
        for count in clients:
            report = run_closed_loop(target, count, duration_s, 10**7)
            by_load[count] = {"images_per_s": round(report.throughput_rps, 1),
                              "p50_ms": round(report.latency_ms["p50"], 1),
                              "errors": sum(report.errors.values())}
        return by_load
    finally:
        stop(instance)
