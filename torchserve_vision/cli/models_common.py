"""What the `models` subcommands share: their common flags, worker counts, and how they print
a management answer."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from torchserve_vision import paths
from torchserve_vision.archives.versions import ArchiveError, archive_batching, archive_deadline_ms
from torchserve_vision.cli.common import (
    client_from,
    connection_flags,
    json_flag,
    model_store_flag,
)
from torchserve_vision.client import TorchServeClient, gathered_by_agent
from torchserve_vision.model_descriptions import QUEUED, ServingSettings
from torchserve_vision.model_lock import model_lock
from torchserve_vision.photos import photo_path
from torchserve_vision.rollout import (
    WORKERS_DEADLINE_MARGIN_S,
    RolloutError,
)
from torchserve_vision.server_state import default_version, local_gpu_count
from torchserve_vision.shadow import traffic_dir_of


# --- output -------------------------------------------------------------------------------------
def batching_text(description: dict[str, Any], by_agent: bool | None = None) -> str:
    """The version's batching; `by_agent` False (TorchServeClient.batched_by_agent): it asks for
    queued batching on a frontend without the agent, whose own ContinuousBatching waits up to
    the max batch delay for company."""
    if description.get("continuousBatching") and by_agent is False:
        return (f"queued batching asked, but the frontend runs without the agent: TorchServe's "
                f"ContinuousBatching, max batch delay {description['maxBatchDelay']} ms")
    if description.get("continuousBatching"):
        deadline_ms = description.get("clientTimeoutInMills") or 0
        deadline = f", deadline {deadline_ms} ms" if deadline_ms else ", no deadline"
        return f"queued batching (no delay{deadline})"
    return f"max batch delay {description['maxBatchDelay']} ms"


def describe_lines(description: dict[str, Any], in_batch: dict[tuple[str, str], int] | None = None
                   ) -> list[str]:
    """`description` as text; `in_batch`: TorchServeClient.requests_in_batch() (None: unknown),
    which says whether the agent batches the version."""
    queue = description.get("jobQueueStatus", {})
    by_agent = gathered_by_agent(in_batch, description)
    lines = [f"{description['modelName']} {description['modelVersion']}  ({description['modelUrl']})",
             f"  batch size {description['batchSize']}, {batching_text(description, by_agent)},"
             f" workers min {description['minWorkers']} / max {description['maxWorkers']},"
             f" response timeout {description['responseTimeout']} s",
             f"  queue: {queue.get('pendingRequests', '?')} pending,"
             f" {queue.get('remainingCapacity', '?')} free"]
    for worker in description.get("workers", []):
        device = f"GPU {worker.get('gpuUsage')}" if worker.get("gpu") else "CPU"
        lines.append(f"  worker {worker['id']}: {worker['status']}, pid {worker.get('pid')}, {device}")
    handler = description.get("customizedMetadata")
    if isinstance(handler, dict):
        lines.append(f"  a worker's handler: {handler.get('device')}, {handler.get('precision')}")
        for role, runner in (handler.get("runners") or {}).items():
            lines.extend(runner_lines(role, runner))
    return lines


def runner_lines(role: str, runner: dict[str, Any]) -> list[str]:
    """One network's runner as a worker describes it: what serves, from which file, on which
    CPU kind's order, then each runner refused on the way and why."""
    served = runner.get("file") or "no compiled model serves"
    kind = f", {runner['cpu_kind']} order" if "cpu_kind" in runner else ""
    lines = [f"    {role}: {runner.get('runner')} ({served}{kind})"]
    for refusal in runner.get("refused") or []:
        lines.append(f"      refused {refusal.get('runner')} ({refusal.get('reason')}): "
                     f"{refusal.get('message')}")
    return lines


def say(answer: Any) -> None:
    """Print a management answer's status line."""
    print(answer.get("status", answer) if isinstance(answer, dict) else answer)


def show(value: Any, as_json: bool, lines: list[str]) -> None:
    print(json.dumps(value, indent=2) if as_json else "\n".join(lines))


# --- worker counts ------------------------------------------------------------------------------
def gpu_count(client: TorchServeClient, gpus: int | None) -> int:
    """GPUs of the server host: --gpus, or this machine's when the server is on loopback."""
    if gpus is not None:
        return gpus
    host = urlparse(client.management_url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise RolloutError("the server is not on this machine: say how many GPUs it has with --gpus")
    return local_gpu_count()


def worker_counts(args: argparse.Namespace, client: TorchServeClient,
                  fallback: tuple[int, int]) -> tuple[int, int]:
    """(min, max) workers from --workers-per-gpu, --min/--max or --workers, else `fallback`."""
    if getattr(args, "workers_per_gpu", None):
        gpus = gpu_count(client, args.gpus)
        if gpus == 0:
            raise RolloutError("this host has no GPU: give worker counts with --min/--max instead")
        total = args.workers_per_gpu * gpus
        return total, total
    low = getattr(args, "min", None) or getattr(args, "workers", None) or fallback[0]
    high = getattr(args, "max", None) or max(low, getattr(args, "workers", None) or fallback[1])
    if high < low:
        raise RolloutError(f"--max ({high}) is below --min ({low})")
    return low, high


def changing(client: TorchServeClient, args: argparse.Namespace) -> AbstractContextManager[None]:
    """The model's lock for a change (none for a dry run): see torchserve_vision.model_lock."""
    return nullcontext() if client.dry_run else model_lock(args.history, args.model)


# --- arguments ----------------------------------------------------------------------------------
def add_workers(parser: argparse.ArgumentParser, with_total: bool) -> None:
    parser.add_argument("--min", type=int, help="minimum workers")
    parser.add_argument("--max", type=int, help="maximum workers")
    if with_total:
        parser.add_argument("--workers", type=int, help="workers (min = max)")
    parser.add_argument("--workers-per-gpu", type=int,
                        help="k workers on each GPU of the host: min = max = k x GPUs")
    parser.add_argument("--gpus", type=int, help="GPUs of the server host (default: this machine's)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for workers (default: the version's start-up "
                             f"timeout + {WORKERS_DEADLINE_MARGIN_S:.0f} s)")


def add_candidate(parser: argparse.ArgumentParser) -> None:
    """How `shadow` and `canary` register a candidate archive (see `candidate_plan`)."""
    parser.add_argument("--smoke-image", type=Path, default=photo_path(),
                        help="the candidate's smoke test (default: scikit-image's chelsea.png)")
    add_workers(parser, with_total=True)
    parser.set_defaults(batching=None)


def add_batching(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-batch-delay", type=int, help="milliseconds")
    parser.add_argument("--response-timeout", type=int, help="seconds")
    parser.add_argument("--startup-timeout", type=int,
                        help="seconds a worker may take to load before TorchServe restarts it")


def model_flags() -> list[argparse.ArgumentParser]:
    """The flags every `models` subcommand takes: the server's addresses, --json, --model-store,
    --dry-run and --history."""
    common = argparse.ArgumentParser(add_help=False, parents=[connection_flags(), json_flag(),
                                                              model_store_flag()])
    common.add_argument("--dry-run", action="store_true", help="print changing calls, do not send")
    common.add_argument("--history", type=Path, default=paths.ROLLOUT_HISTORY,
                        help=f"rollout history file, for rollback (default: {paths.ROLLOUT_HISTORY})")
    return [common]


def with_client(command: Callable[[TorchServeClient, argparse.Namespace], None]
                ) -> Callable[[argparse.Namespace], int]:
    """A subcommand's runner: `command` with the client its flags name (a dry run's with
    --dry-run); exit status 0 when it returns."""
    def run(args: argparse.Namespace) -> int:
        command(client_from(args, args.dry_run), args)
        return 0

    return run


def planned_batching(args: argparse.Namespace, archive: str, base: ServingSettings) -> str:
    """--batching (for a copy of the current archive), else the archive's own policy (the
    current version's when the archive cannot say: TorchServe then refuses it at registration,
    and the rollout undoes itself)."""
    if getattr(args, "batching", None):
        return str(args.batching)
    path = args.model_store / archive
    try:
        return archive_batching(path) if archive and path.is_file() else base.batching
    except ArchiveError:
        return base.batching


def planned_deadline_ms(args: argparse.Namespace, archive: str, batching: str,
                        base: ServingSettings) -> int:
    """--deadline-ms (for a copy of the current archive), else the archive's own (the current
    version's when the archive cannot say); none with delayed batching, which cannot answer one."""
    requested = getattr(args, "deadline_ms", None)
    if batching != QUEUED:
        if requested:
            raise RolloutError("--deadline-ms needs queued batching (TorchServe's own batching "
                               "drops an expired request without answering it)")
        return 0
    if requested is not None:
        if requested < 0:
            raise RolloutError(f"--deadline-ms must be 0 (none) or more, got {requested}")
        return int(requested)
    path = args.model_store / archive
    try:
        return archive_deadline_ms(path) if archive and path.is_file() else base.deadline_ms
    except ArchiveError:
        return base.deadline_ms


def split_traffic_dir(client: TorchServeClient, model: str) -> Path:
    """Where the front serving `model`'s default version keeps its split."""
    stable = default_version(client, model)
    if stable is None:
        raise RolloutError(f"{model} is not registered")
    return traffic_dir_of(client, model, stable["modelVersion"])
