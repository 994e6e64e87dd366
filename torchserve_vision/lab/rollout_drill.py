"""Rollouts, rollbacks, scaling and a killed worker under steady open-loop load, step by step;
with `--canary`, the shadow, canary steps, promotion and an aborted walk behind the front.

    torchserve-vision lab rollout-drill          # the default classifier of model_store/, 25% load
    torchserve-vision lab rollout-drill --load-fraction 0.25 --json
    torchserve-vision lab rollout-drill --canary

Starts its own TorchServe (config/config.properties on free 127.0.0.1 ports, from the model
store), measures the classifier's capacity (closed loop, 16 clients), then offers Poisson
arrivals at a fraction of it for the whole drill while `torchserve-vision models` runs each step
(as a separate process, as a user runs it):
rollout to a second version (a copy of the archive), rollback, scale up by one worker, scale
down by one (a rollout of a copy with fewer workers), rollback of that scale-down, and a SIGKILL
of one worker. For each step: the command's time and exit status, requests answered while it
ran (and for 2 s after), failures (non-200 or no answer within 30 s) and latency.

`--canary` starts `server run` with its front (HAProxy) instead and sends the load through the
front: shadow on at 5% and off, canary 10% and 25%, a rollback of one step, 50%, 100%,
promotion, its rollback, and a stepped walk whose gates no candidate passes (p99 at most 0 ms:
it exits 1 and removes the split). The candidate is a copy of the served archive under another
version.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.client import TorchServeClient
from torchserve_vision.lab.loadgen import (
    LoadTarget,
    Result,
    latency_summary,
    run_closed_loop,
    run_open_loop,
)
from torchserve_vision.lab.pods import Pod
from torchserve_vision.photos import photo_path
from torchserve_vision.server_process import (
    TorchServeInstance,
    instance_for,
    start,
    stop,
)
from torchserve_vision.server_state import kill_worker_and_wait
from torchserve_vision.torchserve_config import free_ports, server_config

SETTLE_S = 2.0


@dataclass(frozen=True)
class Step:
    name: str
    command: str
    seconds: float
    exit_code: int
    started_s: float   # on the load's clock
    ended_s: float


def step_rows(steps: Sequence[Step], results: Sequence[Result]) -> list[dict[str, object]]:
    rows = []
    for step in steps:
        window = [r for r in results if step.started_s <= r.scheduled_s < step.ended_s + SETTLE_S]
        failed = [r for r in window if r.status != 200]
        ok = [r.latency_ms for r in window if r.status == 200]
        summary = latency_summary(ok)
        rows.append({"step": step.name, "command": step.command, "seconds": round(step.seconds, 1),
                     "exit": step.exit_code, "requests": len(window), "failed": len(failed),
                     "failed_statuses": sorted({r.status for r in failed}),
                     "p50_ms": round(summary["p50"], 1), "p99_ms": round(summary["p99"], 1)})
    return rows


def markdown(rows: Sequence[dict[str, object]]) -> str:
    lines = ["| step | command | s | exit | requests | failed | p50 ms | p99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | `{r['command']}` | {r['seconds']} | {r['exit']} | {r['requests']} | "
              f"{r['failed']} | {r['p50_ms']} | {r['p99_ms']} |" for r in rows]
    return "\n".join(lines)


# (step name, `torchserve-vision models` arguments)
Commands = list[tuple[str, list[str]]]


def rollout_commands(model: str, second: str, workers: int) -> Commands:
    return [
        ("rollout", ["rollout", model, second]),
        ("rollback", ["rollback", model]),
        ("scale up", ["scale", model, "--workers", str(workers + 1)]),
        ("scale down", ["scale", model, "--workers", str(workers)]),
        ("rollback of the scale-down", ["rollback", model]),
    ]


def canary_commands(model: str, candidate: str) -> Commands:
    return [
        ("shadow on, 5%", ["shadow", model, candidate, "--percent", "5"]),
        ("shadow off", ["shadow", model, "--off"]),
        ("canary 10%", ["canary", model, candidate, "--percent", "10"]),
        ("canary 25%", ["canary", model, "--percent", "25"]),
        ("rollback of one step (10% again)", ["rollback", model]),
        ("canary 50%", ["canary", model, "--percent", "50"]),
        ("canary 100%", ["canary", model, "--percent", "100"]),
        ("promote", ["canary", model, "--promote"]),
        ("rollback of the promotion", ["rollback", model]),
        ("walk stopped by its gates (exit 1), split removed",
         ["canary", model, "--steps", "50,100", "--auto", "--hold", "5", "--max-p99-ratio", "0",
          "--p99-slack", "0"]),
    ]


def run_steps(instance: TorchServeInstance, store: Path, model: str, clock: Callable[[], float],
              history: Path, canary: bool) -> list[Step]:
    client = TorchServeClient(instance.management_url, instance.inference_url,
                              metrics_url=instance.metrics_url)
    current = client.describe(model, None)[0]
    second = archive_with_version(store, current["modelUrl"], f"{current['modelVersion']}-drill")
    commands = (canary_commands(model, second) if canary
                else rollout_commands(model, second, len(current["workers"])))
    common = ["--management-url", instance.management_url, "--inference-url", instance.inference_url,
              "--metrics-url", instance.metrics_url, "--model-store", str(store),
              "--history", str(history)]
    steps = []
    for name, arguments in commands:
        started, started_s = time.monotonic(), clock()
        code = subprocess.run([sys.executable, "-m", "torchserve_vision", "models", *arguments, *common],
                              check=False).returncode
        steps.append(Step(name, "torchserve-vision models " + " ".join(arguments),
                          time.monotonic() - started, code, started_s, clock()))
        time.sleep(SETTLE_S)
    if not canary:
        started_s = clock()
        seconds = kill_worker_and_wait(client, model)
        steps.append(Step("SIGKILL one worker", "kill -9 <worker pid>", seconds, 0, started_s, clock()))
        time.sleep(SETTLE_S)
    return steps


@contextmanager
def own_server(config: Path, store: Path, run_dir: Path, fronted: bool
               ) -> Iterator[tuple[TorchServeInstance, str]]:
    """A TorchServe of its own for the drill, and the base URL clients send to: its inference
    address, or with `fronted` the front of `server run` (HAProxy) before it."""
    config = server_config(run_dir, store, config)
    if fronted:
        pod = Pod("drill", config, run_dir, store, drain_delay_s=0.0, front_port=free_ports(1)[0])
        with pod.running():
            yield pod.instance, f"http://127.0.0.1:{pod.front_port}"
        return
    instance = instance_for(config, run_dir)
    start(instance, store)
    try:
        yield instance, instance.inference_url
    finally:
        stop(instance)


def drill(config: Path, store: Path, model: str, load_fraction: float,
          canary: bool = False) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="ts-drill-") as tmp, \
            own_server(config, store, Path(tmp) / "run", canary) as (instance, base_url):
        try:
            target = LoadTarget(f"{base_url}/predictions/{model}",
                                [photo_path().read_bytes()], timeout_s=30.0)
            run_closed_loop(target, clients=16, duration_s=3, max_requests=100_000)  # warm-up
            capacity = run_closed_loop(target, clients=16, duration_s=8, max_requests=100_000)
            rate = capacity.throughput_rps * load_fraction
            results: list[Result] = []
            stop_load = threading.Event()
            started = time.perf_counter()
            load = threading.Thread(target=run_open_loop, daemon=True, kwargs={
                "target": target, "rate_rps": rate, "duration_s": 3600, "max_requests": 10_000_000,
                "stop": stop_load, "results": results, "started": started})
            load.start()
            try:
                steps = run_steps(instance, store, model, lambda: time.perf_counter() - started,
                                  Path(tmp) / "history.json", canary)
            finally:
                stop_load.set()
                load.join(timeout=60)
            return {"capacity_rps": round(capacity.throughput_rps, 1), "rate_rps": round(rate, 1),
                    "steps": step_rows(steps, results)}
        finally:
            for leftover in store.glob(f"{model}-*-drill*.mar"):
                leftover.unlink()
            for leftover in store.glob(f"{model}-*-w*.mar"):
                leftover.unlink()
