"""Versioned rollouts on a live TorchServe, one function per step.

rollout: register the new version -> scale it and wait for its workers -> smoke-test it at
/predictions/{model}/{version} -> set it as default -> wait for the old version's queue to drain
-> unregister the old version. Any failure stops the rollout, restores the old default, removes
what the rollout added, and raises RolloutError with the server's message.

Each completed rollout is appended to a history file, which `rollback` reads to find the
previous version (and its archive and settings, to re-register it when it is gone).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from scripts.management_client import ManagementError, TorchServeClient

Log = Callable[[str], None]


class RolloutError(RuntimeError):
    """The rollout failed and was undone; the message says which step and why."""


@dataclass(frozen=True)
class ServingSettings:
    """Batch and worker settings of a model version (TorchServe fixes them at registration);
    also the `serving:` section of config/models.yaml."""

    batch_size: int = 8
    max_batch_delay_ms: int = 20
    min_workers: int = 1
    max_workers: int = 1
    response_timeout_s: int = 60
    startup_timeout_s: int = 120    # TorchServe kills a worker that takes longer to load

    @classmethod
    def of_version(cls, description: dict[str, Any]) -> ServingSettings:
        return cls(description["batchSize"], description["maxBatchDelay"], description["minWorkers"],
                   description["maxWorkers"], description["responseTimeout"],
                   description.get("startupTimeout", cls.startup_timeout_s))


@dataclass(frozen=True)
class RolloutPlan:
    model: str
    archive: str                      # file name in the model store
    settings: ServingSettings
    smoke_image: bytes
    expect_labels: frozenset[str] = frozenset()
    compare_with_current: bool = False
    keep_old: bool = False
    drain_timeout_s: float = 120.0
    drain_grace_s: float = 2.0
    workers_timeout_s: float = 300.0


# --- archives ---------------------------------------------------------------------------------
def archive_manifest(path: Path) -> dict[str, Any]:
    """The `model` section of an archive's MANIFEST.json (modelName, modelVersion, ...)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return dict(json.loads(archive.read("MAR-INF/MANIFEST.json"))["model"])
    except (OSError, KeyError, zipfile.BadZipFile, ValueError) as error:
        raise RolloutError(f"{path} is not a readable model archive: {error}") from None


def archive_with_version(store: Path, archive: str, version: str) -> str:
    """Copy `archive` in the model store as `<name>-<version>.mar` with that manifest version.

    TorchServe fixes batch size and delay at registration and keys versions by the manifest's
    version, so new batch settings for the same archive need a new version: this is it.
    """
    source = store / archive
    manifest = archive_manifest(source)
    target_name = f"{manifest['modelName']}-{version}.mar"
    with (tempfile.NamedTemporaryFile(dir=store, suffix=".tmp", delete=False) as tmp,
          zipfile.ZipFile(source) as old, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as new):
        for item in old.infolist():
            data = old.read(item.filename)
            if item.filename == "MAR-INF/MANIFEST.json":
                document = json.loads(data)
                document["model"]["modelVersion"] = version
                data = json.dumps(document, indent=2).encode()
            new.writestr(item, data)
    shutil.move(tmp.name, store / target_name)
    return target_name


def settings_version(base_version: str, settings: ServingSettings) -> str:
    """`1.0` + batch 16, delay 5 ms -> `1.0-bs16-d5` (a previous suffix is replaced)."""
    return f"{base_version.split('-bs')[0]}-bs{settings.batch_size}-d{settings.max_batch_delay_ms}"


# --- reading the server -----------------------------------------------------------------------
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


def ready_workers(description: dict[str, Any]) -> int:
    return sum(worker.get("status") == "READY" for worker in description.get("workers", []))


def wait_for_workers(client: TorchServeClient, model: str, version: str, count: int,
                     timeout_s: float) -> None:
    if client.dry_run:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        description = client.describe(model, version)[0]
        if ready_workers(description) >= count:
            return
        if time.monotonic() > deadline:
            raise RolloutError(f"{model} {version}: {ready_workers(description)} of {count} workers "
                               f"ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def wait_for_empty_queue(pending: Callable[[], int], timeout_s: float, grace_s: float) -> bool:
    """Wait until `pending()` (queued requests) has stayed 0 for half a second, then `grace_s` for
    the batches workers are computing (TorchServe does not show those). False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    empty_polls = 0
    while empty_polls < 5:
        if time.monotonic() > deadline:
            return False
        empty_polls = empty_polls + 1 if pending() == 0 else 0
        time.sleep(0.1)
    time.sleep(grace_s)
    return True


def wait_for_drain(client: TorchServeClient, model: str, version: str, timeout_s: float,
                   grace_s: float) -> None:
    """Wait until the version's job queue stays empty, then `grace_s` for the batch in flight."""
    if client.dry_run:
        return

    def pending() -> int:
        return int(client.describe(model, version)[0].get("jobQueueStatus", {}).get("pendingRequests", 0))

    if not wait_for_empty_queue(pending, timeout_s, grace_s):
        raise RolloutError(f"{model} {version} still had {pending()} queued requests after "
                           f"{timeout_s:.0f} s")


# --- smoke test -------------------------------------------------------------------------------
def top_label(answer: Any) -> str | None:
    """The best class (classifier) or the best detection's label (detector); None if nothing."""
    if isinstance(answer, list) and answer and isinstance(answer[0], dict):
        return str(answer[0].get("label"))
    return None


def smoke_test(client: TorchServeClient, model: str, version: str, image: bytes,
               expect_labels: Collection[str], reference: Any | None) -> Any:
    """Send a real image to this version alone; check the answer against expectations."""
    if client.dry_run:
        print(f"[dry-run] POST {client.inference_url}/predictions/{model}/{version} (smoke test)")
        return None
    answer = client.predict(model, version, image)
    label = top_label(answer)
    if expect_labels and label not in expect_labels:
        raise RolloutError(f"smoke test: {model} {version} answered {label!r}, expected one of "
                           f"{sorted(expect_labels)}")
    if reference is not None and label != top_label(reference):
        raise RolloutError(f"smoke test: {model} {version} answered {label!r}, the current version "
                           f"{top_label(reference)!r}")
    return answer


# --- rollout and rollback -------------------------------------------------------------------
def undo(client: TorchServeClient, model: str, new_version: str, old_version: str | None,
         default_changed: bool, log: Log) -> None:
    """Put the old version back as default and remove the new one, as far as possible."""
    if default_changed and old_version is not None:
        client.set_default(model, old_version)
        log(f"restored {model} {old_version} as default")
    try:
        client.unregister(model, new_version)
        log(f"unregistered {model} {new_version}")
    except ManagementError as error:
        log(f"could not unregister {model} {new_version}: {error}")


def rollout(client: TorchServeClient, plan: RolloutPlan, store: Path, log: Log) -> dict[str, Any]:
    """Swap `plan.model` to the archive's version with no failed request; return a history entry."""
    manifest = archive_manifest(store / plan.archive)
    new_version = str(manifest["modelVersion"])
    if manifest["modelName"] != plan.model:
        raise RolloutError(f"{plan.archive} holds model {manifest['modelName']!r}, not {plan.model!r}")
    current = default_version(client, plan.model)
    old_version = current["modelVersion"] if current else None
    if any(v["modelVersion"] == new_version for v in versions_of(client, plan.model)):
        raise RolloutError(f"{plan.model} {new_version} is already registered")
    reference = None
    if plan.compare_with_current and old_version is not None and not client.dry_run:
        reference = client.predict(plan.model, old_version, plan.smoke_image)
    settings = plan.settings
    log(f"registering {plan.archive} as {plan.model} {new_version}")
    client.register(plan.archive, settings.batch_size, settings.max_batch_delay_ms,
                    settings.min_workers, settings.response_timeout_s)
    default_changed = False
    try:
        client.scale(plan.model, new_version, settings.min_workers, settings.max_workers)
        wait_for_workers(client, plan.model, new_version, settings.min_workers, plan.workers_timeout_s)
        log(f"{plan.model} {new_version}: {settings.min_workers} worker(s) ready; smoke test")
        smoke_test(client, plan.model, new_version, plan.smoke_image, plan.expect_labels, reference)
        client.set_default(plan.model, new_version)
        default_changed = True
        log(f"{plan.model} {new_version} is the default")
        if old_version is not None and not plan.keep_old:
            wait_for_drain(client, plan.model, old_version, plan.drain_timeout_s, plan.drain_grace_s)
            client.unregister(plan.model, old_version)
            log(f"unregistered {plan.model} {old_version}")
    except (ManagementError, RolloutError) as error:
        undo(client, plan.model, new_version, old_version, default_changed, log)
        raise RolloutError(f"rollout of {plan.model} {new_version} failed and was undone: {error}") from None
    return {"model": plan.model, "to_version": new_version, "to_archive": plan.archive,
            "from_version": old_version, "from_archive": current["modelUrl"] if current else None,
            "from_settings": asdict(ServingSettings.of_version(current)) if current else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def record(history_file: Path, entry: dict[str, Any]) -> None:
    history = json.loads(history_file.read_text()) if history_file.is_file() else []
    history.append(entry)
    history_file.parent.mkdir(parents=True, exist_ok=True)
    history_file.write_text(json.dumps(history, indent=2))


def last_rollout(history_file: Path, model: str, current_version: str) -> dict[str, Any]:
    history = json.loads(history_file.read_text()) if history_file.is_file() else []
    for entry in reversed(history):
        if entry["model"] == model and entry["to_version"] == current_version and entry["from_version"]:
            return dict(entry)
    raise RolloutError(f"no recorded rollout of {model} to {current_version} in {history_file}; "
                       "nothing to roll back to")


def rollback(client: TorchServeClient, model: str, history_file: Path, store: Path,
             plan_template: RolloutPlan, log: Log) -> dict[str, Any]:
    """Make the version before the current one the default again: at once when it is still
    registered, else by rolling out its archive again with its recorded settings."""
    current = default_version(client, model)
    if current is None:
        raise RolloutError(f"{model} is not registered")
    entry = last_rollout(history_file, model, current["modelVersion"])
    previous = entry["from_version"]
    if any(v["modelVersion"] == previous for v in versions_of(client, model)):
        client.set_default(model, previous)
        log(f"{model} {previous} is the default again ({current['modelVersion']} stays registered)")
        return {**entry, "to_version": previous, "from_version": current["modelVersion"],
                "to_archive": entry["from_archive"], "from_archive": current["modelUrl"]}
    plan = replace(plan_template, model=model, archive=entry["from_archive"],
                   settings=ServingSettings(**entry["from_settings"]))
    log(f"{model} {previous} is gone; re-registering it from {entry['from_archive']}")
    return rollout(client, plan, store, log)
