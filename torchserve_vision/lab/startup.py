"""Measure how fast workers become READY: a cold and a warm server start, a killed worker's
replacement, a scale-up worker, and a new version registered beside the default.

    torchserve-vision lab startup                # config/config.properties, model_store/
    taskset -c 0 .venv/bin/torchserve-vision lab startup # the same on one core (a slower CPU)

The server runs on free 127.0.0.1 ports in its own run directory (beside a running demo), from
the archives in the model store; nothing is compiled at start. Each figure is wall time from the
action to READY workers, polled every 0.1 s; the workers' own `startup_ms` (process start to
ready, from their log lines) is printed too. Prints a Markdown table; --json for the figures.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.client import TorchServeClient
from torchserve_vision.server_process import (
    TorchServeInstance,
    instance_for,
    start,
    stop,
)
from torchserve_vision.server_state import kill_worker_and_wait, ready_workers
from torchserve_vision.torchserve_config import server_config
from torchserve_vision.waiting import wait_until

READY_LINE = re.compile(r"worker ready model=(\S+) version=(\S+) device=\S+ runner=(\S+) .*"
                        r"startup_ms=(\d+)")


def worker_startup_ms(instance: TorchServeInstance) -> list[tuple[str, str, int]]:
    """(model, runner, startup_ms) of every `worker ready` line in the worker log so far."""
    log = instance.log_dir / "model_log.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    return [(match[1], match[3], int(match[4])) for match in READY_LINE.finditer(text)]


def scale_up_s(client: TorchServeClient, model: str) -> float:
    current = client.describe(model, None)[0]
    count, version = len(current["workers"]), current["modelVersion"]
    started = time.monotonic()
    client.scale(model, version, count + 1, count + 1)
    wait_until(lambda: ready_workers(client.describe(model, version)[0]) >= count + 1, 300,
               f"{count + 1} READY workers of {model} {version}")
    elapsed = time.monotonic() - started
    client.scale(model, version, current["minWorkers"], current["maxWorkers"])  # idle: no load here
    return elapsed


def new_version_s(client: TorchServeClient, model: str, store: Path) -> float:
    """Register a copy of the default version's archive as another version, 1 worker, to READY."""
    current = client.describe(model, None)[0]
    archive = archive_with_version(store, current["modelUrl"], "startup-check")
    try:
        started = time.monotonic()
        client.register(archive, current["batchSize"], current["maxBatchDelay"], 1,
                        current["responseTimeout"], current["startupTimeout"])
        wait_until(lambda: ready_workers(client.describe(model, "startup-check")[0]) >= 1, 300,
                   f"a READY worker of {model} startup-check")
        return time.monotonic() - started
    finally:
        client.unregister(model, "startup-check")
        (store / archive).unlink()


def measure(config: Path, store: Path, model: str) -> dict[str, float | list[tuple[str, str, int]]]:
    figures: dict[str, float | list[tuple[str, str, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="ts-startup-") as tmp:
        for run in ("cold", "warm"):
            run_dir = Path(tmp) / run
            instance = instance_for(server_config(run_dir, store, config), run_dir)
            try:
                started = time.monotonic()
                start(instance, store)
                figures[f"{run} start to every worker READY"] = time.monotonic() - started
                figures[f"{run} worker startup_ms"] = worker_startup_ms(instance)
                if run == "warm":
                    client = TorchServeClient(instance.management_url, instance.inference_url)
                    figures["killed worker (SIGKILL) to READY"] = kill_worker_and_wait(client, model)
                    figures["scale-up worker to READY"] = scale_up_s(client, model)
                    figures["new version registered to READY"] = new_version_s(client, model, store)
            finally:
                stop(instance)
    return figures


def markdown(figures: dict[str, float | list[tuple[str, str, int]]]) -> str:
    lines = ["| what | seconds |", "|---|---|"]
    for name, value in figures.items():
        if isinstance(value, list):
            shown = ", ".join(f"{model} ({runner}) {ms / 1000:.1f}" for model, runner, ms in value)
        else:
            shown = f"{value:.1f}"
        lines.append(f"| {name} | {shown} |")
    return "\n".join(lines)
