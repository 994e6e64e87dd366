"""The response cache, measured in one run on one server: traffic with 0 %, 50 % and 90 % repeats
(closed and open loop) with the cache off, in-worker only, and Redis only; a hit's latency for a
lone client; Redis round trips per batch; a Redis outage under load.

    bash scripts/demo.sh        # a running server with the model API on
    torchserve-vision lab cache --clients 16 --duration 10

Three copies of the model's archive (`<archive>` with only `handler.cache` changed: no cache;
`memory_bytes` 64 MB; `memory_bytes` 0 with a Redis this command starts on a free port, no
persistence) are registered side by side with the model's serving settings. Traffic: a repeat is
one of 20 "hot" photos; every other request is a photo never sent before in that run (a JPEG
from `cascade_tradeoff.cascade_inputs` with a unique suffix after its end marker: the same pixels
to decode, other bytes to hash). Open-loop runs offer 80 % of the cache-off closed-loop
throughput at the same repeat share. The lab's registrations and Redis are removed at the end.
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, overload

from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.client import TorchServeClient
from torchserve_vision.lab.cascade_tradeoff import cascade_inputs
from torchserve_vision.lab.compare import register, unregister_all
from torchserve_vision.lab.loadgen import LoadTarget, Report, run_closed_loop, run_open_loop
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.server_state import served_default_version
from torchserve_vision.torchserve_config import free_ports

HOT_PHOTOS = 20
REPEAT_SHARES = (0.0, 0.5, 0.9)
CONFIGS: dict[str, dict[str, Any] | None] = {"off": None, "memory": {"memory_bytes": 64 * 1024 * 1024},
           "redis": {"memory_bytes": 0, "redis_timeout_ms": 50, "breaker_errors": 3,
                     "breaker_open_s": 5}}


class RepeatTraffic(Sequence[bytes]):
    """Request `i` of a run: with probability `repeat_share` one of the hot photos, else a photo
    not sent before in this run. Deterministic in `i`, computed on demand."""

    def __init__(self, photos: Sequence[bytes], repeat_share: float, run: int) -> None:
        self.photos = photos
        self.repeat_share = repeat_share
        self.run = run

    def __len__(self) -> int:
        return 10**8

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            raise TypeError("RepeatTraffic is indexed one request at a time")
        digest = hashlib.blake2b(f"{self.run}:{index}".encode(), digest_size=8).digest()
        draw = int.from_bytes(digest[:4], "big") / 2**32
        if draw < self.repeat_share:
            return self.photos[int.from_bytes(digest[4:], "big") % HOT_PHOTOS]
        fresh = self.photos[HOT_PHOTOS + index % (len(self.photos) - HOT_PHOTOS)]
        return fresh + f"{self.run}:{index}".encode()   # after the JPEG's end marker


@dataclass(frozen=True)
class CacheRun:
    config: str
    repeat_share: float
    mode: str                  # "closed" | "open"
    throughput_rps: float
    offered_rps: float | None
    p50_ms: float
    p99_ms: float
    errors: int


@contextmanager
def local_redis() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_ports(1)[0]
    with tempfile.TemporaryDirectory(prefix="lab-redis-") as directory:
        process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", directory],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            yield f"redis://127.0.0.1:{port}/0", process
        finally:
            process.kill()
            process.wait()


def as_run(config: str, share: float, mode: str, report: Report) -> CacheRun:
    return CacheRun(config, share, mode, report.throughput_rps, report.offered_rps,
                    report.latency_ms.get("p50", 0.0), report.latency_ms.get("p99", 0.0),
                    report.sent - report.succeeded)


def redis_round_trips_ms(url: str, batch_size: int, answer_bytes: int = 400,
                         repeats: int = 200) -> dict[str, float]:
    """Median ms of one batch's lookup (MGET of `batch_size` keys) and store (pipelined SET EX)."""
    import redis

    client = redis.Redis.from_url(url)
    keys = [f"tsv:lab:{index}" for index in range(batch_size)]
    value = b"x" * answer_bytes

    def timed(call: Any) -> float:
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            samples.append((time.perf_counter() - started) * 1000)
        return statistics.median(samples)

    def store() -> None:
        pipeline = client.pipeline(transaction=False)
        for key in keys:
            pipeline.set(key, value, ex=60)
        pipeline.execute()

    return {"store_ms": timed(store), "lookup_ms": timed(lambda: client.mget(keys))}


def benchmark(client: TorchServeClient, store: Path, model: str, clients: int,
              duration_s: float) -> dict[str, Any]:
    current = served_default_version(client, model)
    settings = ServingSettings.of_version(current)
    photos = cascade_inputs(320)
    names = {config: f"lab_cache_{config}" for config in CONFIGS}
    copies: list[str] = []
    runs: list[CacheRun] = []
    with local_redis() as (redis_url, redis_process):
        try:
            for config, cache in CONFIGS.items():
                if cache is not None and config == "redis":
                    cache = {**cache, "redis_url": redis_url}
                archive = archive_with_version(store, current["modelUrl"], f"lab-cache-{config}",
                                               {"cache": cache or False})
                copies.append(archive)
                register(client, store, archive, names[config], settings)
            run_index = 0
            for share in REPEAT_SHARES:
                closed: dict[str, float] = {}
                for config in CONFIGS:
                    run_index += 1
                    url = f"{client.inference_url}/predictions/{names[config]}"
                    run_closed_loop(LoadTarget(url, RepeatTraffic(photos, share, -run_index)),
                                    clients, 2.0, 10**7)  # warm-up: its own fresh photos
                    report = run_closed_loop(LoadTarget(url, RepeatTraffic(photos, share, run_index)),
                                             clients, duration_s, 10**7)
                    runs.append(as_run(config, share, "closed", report))
                    closed[config] = report.throughput_rps
                    print(f"  {config}, {share:.0%} repeats: {report.table()}", file=sys.stderr, flush=True)
                rate = 0.8 * closed["off"]
                for config in CONFIGS:
                    run_index += 1
                    url = f"{client.inference_url}/predictions/{names[config]}"
                    report = run_open_loop(LoadTarget(url, RepeatTraffic(photos, share, run_index)),
                                           rate, duration_s, 10**7)
                    runs.append(as_run(config, share, "open", report))
                    print(f"  {config}, {share:.0%} repeats: {report.table()}", file=sys.stderr, flush=True)
            lone = lone_hit_latency(client, names["memory"], photos[0])
            round_trips = redis_round_trips_ms(redis_url, settings.batch_size)
            redis_process.kill()
            redis_process.wait()
            run_index += 1
            url = f"{client.inference_url}/predictions/{names['redis']}"
            outage = run_closed_loop(LoadTarget(url, RepeatTraffic(photos, 0.9, run_index)),
                                     clients, duration_s, 10**7)
            print(f"  redis down, 90% repeats: {outage.table()}", file=sys.stderr, flush=True)
        finally:
            for name in names.values():
                unregister_all(client, name)
            for archive in copies:
                (store / archive).unlink(missing_ok=True)
    return {"model": model, "archive": current["modelUrl"], "settings": asdict(settings),
            "clients": clients, "duration_s": duration_s, "runs": [asdict(run) for run in runs],
            "lone_client_hit_ms": lone, "redis_round_trip_ms": round_trips,
            "redis_down_90": asdict(as_run("redis (down)", 0.9, "closed", outage))}


def lone_hit_latency(client: TorchServeClient, model: str, photo: bytes) -> dict[str, float]:
    """One client sending the same photo: every request after the first is a hit."""
    url = f"{client.inference_url}/predictions/{model}"
    report = run_closed_loop(LoadTarget(url, [photo]), 1, 5.0, 2000)
    return {"p50_ms": report.latency_ms["p50"], "p99_ms": report.latency_ms["p99"]}


def markdown(result: dict[str, Any]) -> str:
    runs = [CacheRun(**run) for run in result["runs"]]
    lines = ["| repeats | loop | off req/s | memory req/s | redis req/s | memory / off | "
             "off p50 / p99 ms | memory p50 / p99 ms | redis p50 / p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for share in REPEAT_SHARES:
        for mode in ("closed", "open"):
            row = {run.config: run for run in runs if run.repeat_share == share and run.mode == mode}
            loop = mode if mode == "closed" else f"open, {row['off'].offered_rps:.0f}/s offered"
            cells = [f"{row[c].p50_ms:.1f} / {row[c].p99_ms:.1f}" for c in CONFIGS]
            lines.append(
                f"| {share:.0%} | {loop} | {row['off'].throughput_rps:.1f} | "
                f"{row['memory'].throughput_rps:.1f} | {row['redis'].throughput_rps:.1f} | "
                f"{row['memory'].throughput_rps / row['off'].throughput_rps:.2f}x | "
                + " | ".join(cells) + f" | {sum(row[c].errors for c in CONFIGS)} |")
    down = result["redis_down_90"]
    trips = result["redis_round_trip_ms"]
    lone = result["lone_client_hit_ms"]
    lines += ["", f"lone client, repeated photo (every request a hit), memory tier: p50 "
              f"{lone['p50_ms']:.1f} ms, p99 {lone['p99_ms']:.1f} ms",
              f"Redis per batch of {result['settings']['batch_size']}: lookup (MGET) "
              f"{trips['lookup_ms']:.2f} ms, store (pipelined SET EX) {trips['store_ms']:.2f} ms",
              f"Redis down (breaker), 90 % repeats, closed loop: {down['throughput_rps']:.1f} req/s, "
              f"p50 {down['p50_ms']:.1f} ms, p99 {down['p99_ms']:.1f} ms, errors {down['errors']}"]
    return "\n".join(lines)

