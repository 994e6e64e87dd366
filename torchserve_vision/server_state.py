"""What a live TorchServe reports about its models, and waiting on it: registered versions, the
default version, READY workers, requests queued and in a batch."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchserve_vision.client import ManagementError, TorchServeClient
from torchserve_vision.errors import NotServed
from torchserve_vision.waiting import wait_until


def versions_of(client: TorchServeClient, model: str) -> list[dict[str, Any]]:
    """Every registered version of `model` ([] when the model is not registered)."""
    try:
        return client.describe(model, "all")
    except ManagementError as error:
        if error.status == 404:
            return []
        raise


def default_version(client: TorchServeClient, model: str) -> dict[str, Any] | None:
    try:
        described = client.describe(model, None)
    except ManagementError as error:
        if error.status == 404:
            return None
        raise
    return described[0] if described else None


def served_default_version(client: TorchServeClient, model: str) -> dict[str, Any]:
    """The default version's description; NotServed when the server does not serve `model`."""
    current = default_version(client, model)
    if current is None:
        raise NotServed(f"{model} is not served at {client.management_url}: start the server "
                        "first (torchserve-vision server start, or scripts/demo.sh)")
    return current


def ready_workers(description: dict[str, Any]) -> int:
    return sum(worker.get("status") == "READY" for worker in description.get("workers", []))


def kill_worker_and_wait(client: TorchServeClient, model: str, timeout_s: float = 120.0) -> float:
    """SIGKILL the first worker of the default version (the server must be on this machine) and
    return the seconds until TorchServe's replacement for it is READY; TimeoutError after
    `timeout_s`."""
    worker = client.describe(model, None)[0]["workers"][0]
    os.kill(int(worker["pid"]), signal.SIGKILL)
    return wait_until(lambda: any(w["id"] == worker["id"] and w["pid"] != worker["pid"]
                                  and w["status"] == "READY"
                                  for w in client.describe(model, None)[0]["workers"]),
                      timeout_s, f"{model}'s worker {worker['id']} to be replaced")


@dataclass(frozen=True)
class Outstanding:
    """Requests a server has not answered yet: `queued` (TorchServe's describe) and `in_batch`
    (taken by a worker, not yet answered: the frontend agent's ts_requests_in_batch) over
    some versions; `unseen` of those versions have no in-batch count (served without the agent's
    queued batching, or the metrics address not reachable)."""

    queued: int
    in_batch: int = 0
    unseen: int = 0

    @property
    def nothing_seen(self) -> bool:
        return self.queued == 0 and self.in_batch == 0


def outstanding(client: TorchServeClient, model: str | None = None,
                version: str | None = None) -> Outstanding:
    """`Outstanding` over one version of `model`, or without `model` over every registered
    version, each described once per call. The queues are read before the batches: a request
    leaves the queue only into a batch, so read in this order none is missed."""
    described = (client.describe(model, version) if model is not None else
                 [each for listed in client.list_models()
                  for each in versions_of(client, listed["modelName"])])
    queued = sum(int(each.get("jobQueueStatus", {}).get("pendingRequests", 0)) for each in described)
    pairs = [(each["modelName"], each["modelVersion"]) for each in described]
    in_batch = client.requests_in_batch()
    seen = [in_batch[pair] for pair in pairs if in_batch is not None and pair in in_batch]
    return Outstanding(queued, sum(seen), len(pairs) - len(seen))


def wait_until_answered(outstanding: Callable[[], Outstanding], timeout_s: float,
                        grace_s: float, poll_s: float = 0.1) -> bool:
    """Wait until nothing is queued or in a batch for five polls in a row (`poll_s` apart: half
    a second); then, only when some version's batches cannot be seen (`Outstanding.unseen`),
    `grace_s` for them. False after `timeout_s` (continuous load)."""
    quiet_polls, unseen = [0], [0]

    def stayed_quiet() -> bool:
        now = outstanding()
        unseen[0] = now.unseen
        quiet_polls[0] = quiet_polls[0] + 1 if now.nothing_seen else 0
        return quiet_polls[0] >= 5

    try:
        wait_until(stayed_quiet, timeout_s, "no request queued or in a batch", interval_s=poll_s)
    except TimeoutError:
        return False
    if unseen[0]:
        time.sleep(grace_s)
    return True


def not_ready_reason(client: TorchServeClient, expected_models: int) -> str | None:
    """None when at least `expected_models` models are registered and each default version has its
    minimum of READY workers (at least one); otherwise why not. /ping alone is not enough: it
    answers Healthy before any model is loaded, and while workers crash-loop."""
    try:
        models = client.list_models()
        if len(models) < expected_models:
            return f"{len(models)} of {expected_models} models registered"
        for model in models:
            current = default_version(client, model["modelName"])
            if current is None:
                return f"{model['modelName']}: no default version"
            needed = max(current["minWorkers"], 1)
            if ready_workers(current) < needed:
                return f"{model['modelName']}: {ready_workers(current)} of {needed} workers READY"
    except ManagementError as error:
        return f"management API: {error.status or 'no answer'}"
    except (KeyError, TypeError) as error:
        return f"unexpected management API answer: {error!r}"
    return None


def models_ready(client: TorchServeClient, expected_models: int) -> bool:
    """Every model's default version has READY workers (see `not_ready_reason`)."""
    return not_ready_reason(client, expected_models) is None


def queued_requests(client: TorchServeClient) -> int:
    """Requests queued (not yet taken by a worker) over every version of every model."""
    return sum(int(version.get("jobQueueStatus", {}).get("pendingRequests", 0))
               for model in client.list_models()
               for version in versions_of(client, model["modelName"]))


def local_gpu_count() -> int:
    """GPUs TorchServe would find on this machine, as it counts them: `CUDA_VISIBLE_DEVICES`
    when set, else the lines of `nvidia-smi --list-gpus` (0 without nvidia-smi). No torch import."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([device for device in visible.split(",") if device.strip() not in ("", "-1")])
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return 0
    listed = subprocess.run([nvidia_smi, "--list-gpus"], capture_output=True, text=True, check=False)
    if listed.returncode != 0:
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
