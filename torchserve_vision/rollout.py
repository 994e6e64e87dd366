"""Versioned rollouts on a live TorchServe, one function per step.

rollout: register the new version -> scale it and wait for its workers -> smoke-test it at
/predictions/{model}/{version} -> set it as default -> wait until the old version has no request
queued or in a batch -> unregister the old version. Register and scale never wait inside the
server (a waiting call holds a frontend thread for as long as a worker takes to start); the
rollout polls `describe` for READY workers, with a deadline from the version's startupTimeout.
Any failure, a time-out or an interruption (Ctrl-C) stops the rollout, restores the old default,
removes what the rollout added, and raises RolloutError (RolloutInterrupted for Ctrl-C) saying
what was undone.

With a journal (torchserve_vision.rollout_history.Journal), each change (rollout, rollback,
scaling) records its intent before it acts and its outcome after. A command that dies half-way
leaves its intent `started`: the same command run again finishes the change (a registered
version with the recorded archive and settings is taken as this change's own, also after it
became the default), `abort` undoes it. `rollback` reads the journal for the latest completed
change and refuses one made on another server (a restarted one) than the live one.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torchserve_vision.archives.versions import (
    ArchiveError,
    archive_digest,
    archive_manifest,
    archive_with_version,
)
from torchserve_vision.client import ManagementError, TorchServeClient
from torchserve_vision.errors import CommandError
from torchserve_vision.model_descriptions import DELAYED, QUEUED, ServingSettings
from torchserve_vision.model_kinds import UnknownKind, best_label, kind_of_entry_module
from torchserve_vision.rollout_history import (
    ChangeKind,
    HistoryEntry,
    Journal,
    half_done_text,
    last_change,
    now_text,
)
from torchserve_vision.server_state import (
    Outstanding,
    default_version,
    outstanding,
    ready_workers,
    versions_of,
    wait_until_answered,
)
from torchserve_vision.waiting import wait_until

Log = Callable[[str], None]


class RolloutError(CommandError, RuntimeError):
    """The rollout failed and was undone; the message says which step and why."""


class RolloutInterrupted(RolloutError):
    """The rollout was interrupted (Ctrl-C) and undone."""


# Seconds past a version's startupTimeout to wait for its workers: TorchServe kills a worker that
# has not loaded by then, so a version not READY by this deadline is not coming.
WORKERS_DEADLINE_MARGIN_S = 30.0


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
    workers_timeout_s: float | None = None  # None: settings.startup_timeout_s + the margin

    @property
    def workers_deadline_s(self) -> float:
        if self.workers_timeout_s is not None:
            return self.workers_timeout_s
        return self.settings.startup_timeout_s + WORKERS_DEADLINE_MARGIN_S


def wait_for_workers(client: TorchServeClient, model: str, version: str, count: int,
                     timeout_s: float, max_worker_starts: int = 4) -> None:
    """Until `count` workers of the version are READY. RolloutError after `timeout_s`, or as soon
    as its workers have been started `max_worker_starts` times (new pids) with none READY: a
    version whose workers die while loading is not coming, however long one waits."""
    if client.dry_run:
        return
    pids: set[Any] = set()
    ready = [0]

    def enough_ready() -> bool:
        description = client.describe(model, version)[0]
        ready[0] = ready_workers(description)
        pids.update({worker.get("pid") for worker in description.get("workers", [])} - {None, "", -1})
        if ready[0] == 0 and len(pids) >= max_worker_starts + count - 1:
            raise RolloutError(f"{model} {version}: its workers died while loading ({len(pids)} "
                               "worker processes started, none READY); the reason is in "
                               "model_log.log")
        return ready[0] >= count

    wait_until(enough_ready, timeout_s, f"{count} READY workers of {model} {version}",
               interval_s=0.5, error=lambda message: RolloutError(f"{message} ({ready[0]} READY)"))


def wait_for_drain(client: TorchServeClient, model: str, version: str, timeout_s: float,
                   grace_s: float) -> None:
    """Wait until the version has no request queued or in a batch (read from the frontend
    agent's count); `grace_s` more only where its batches cannot be seen (see
    `wait_until_answered`). Unregistered before its batch is answered, a version's requests
    would get no answer from TorchServe 0.12 (the agent answers them 503)."""
    if client.dry_run:
        return

    def pending() -> Outstanding:
        return outstanding(client, model, version)

    if not wait_until_answered(pending, timeout_s, grace_s):
        left = pending()
        raise RolloutError(f"{model} {version} still had {left.queued} queued requests and "
                           f"{left.in_batch} in a batch after {timeout_s:.0f} s")


# --- smoke test -------------------------------------------------------------------------------
def answer_reader(manifest: dict[str, Any]) -> Callable[[Any], str | None]:
    """How to read the best label of an archive's answers: its model kind's (by the manifest's
    entry module), or the common shape (best first, each with a label) for an archive of another
    handler."""
    try:
        return kind_of_entry_module(str(manifest.get("handler", ""))).top_label
    except UnknownKind:
        return best_label


def smoke_test(client: TorchServeClient, model: str, version: str, image: bytes,
               expect_labels: Collection[str], reference: Any | None,
               top_label: Callable[[Any], str | None] = best_label) -> Any:
    """Send a real image to this version alone; check its best label against expectations."""
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
@contextmanager
def sigint_handled_by(handler: Any) -> Iterator[None]:
    """SIGINT handled by `handler` for the block, then the handler before again (only possible
    in the main thread; elsewhere this does nothing)."""
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def interrupts_ignored() -> Iterator[None]:
    """Ctrl-C is ignored while an undo runs, so an impatient second Ctrl-C cannot leave the
    server half restored (only possible in the main thread; elsewhere this does nothing)."""
    with sigint_handled_by(signal.SIG_IGN):
        yield


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C during the block takes effect as the block ends, so that a change and its record
    (a canary step and its history entry) happen together or not at all. Nested blocks defer to
    the outermost; only possible in the main thread (elsewhere this does nothing)."""
    received: list[int] = []
    try:
        with sigint_handled_by(lambda number, frame: received.append(number)):
            yield
    finally:
        if received:
            signal.raise_signal(signal.SIGINT)   # to the handler before: raises, records or ignores


def undo(client: TorchServeClient, model: str, new_version: str, old_version: str | None,
         log: Log) -> list[str]:
    """Put the old version back as default and remove the new one if it got registered, as far
    as the server allows; never raises. Returns what it could not do."""
    problems: list[str] = []
    with interrupts_ignored():
        try:
            current = default_version(client, model)
            if old_version is not None and current is not None and current["modelVersion"] != old_version:
                client.set_default(model, old_version)
                log(f"restored {model} {old_version} as default")
            if any(v["modelVersion"] == new_version for v in versions_of(client, model)):
                client.unregister(model, new_version)
                log(f"unregistered {model} {new_version}")
        except ManagementError as error:
            problems.append(str(error))
            log(f"undo incomplete: {error}")
    return problems


def server_identity(client: TorchServeClient, model: str, version: str) -> str | None:
    """The TorchServe frontend this version runs on, as `pid@start time`, from what a worker of
    it reports (handlers' describe: `frontend`); None when no worker says (another handler, a
    dry run, an error)."""
    if client.dry_run:
        return None
    try:
        metadata = client.describe(model, version, customized=True)[0].get("customizedMetadata")
        if isinstance(metadata, str):
            metadata = json.loads(metadata)
        frontend = metadata.get("frontend") if isinstance(metadata, dict) else None
    except (ManagementError, ValueError, IndexError):
        return None
    return f"{frontend['pid']}@{frontend['started']}" if isinstance(frontend, dict) else None


def rollout(client: TorchServeClient, plan: RolloutPlan, store: Path, log: Log,
            journal: Journal | None = None, kind: ChangeKind = "rollout") -> HistoryEntry:
    """Swap `plan.model` to the archive's version with no failed request; return the history
    entry (recorded as `kind` in `journal` when one is given: started before, done after)."""
    manifest = checked_manifest(store, plan.archive, plan.model)
    new_version = str(manifest["modelVersion"])
    pending = journal.pending(plan.model) if journal is not None else None
    if pending is not None and (pending.to_version, pending.to_archive) != (new_version, plan.archive):
        raise RolloutError(half_done_text(pending))
    current = default_version(client, plan.model)
    digest = archive_digest(store / plan.archive)
    intent = pending or HistoryEntry(
        kind=kind, model=plan.model, to_version=new_version, to_archive=plan.archive,
        to_settings=plan.settings, from_version=current["modelVersion"] if current else None,
        from_archive=current["modelUrl"] if current else None,
        from_settings=ServingSettings.of_version(current) if current else None, time=now_text(),
        server=server_identity(client, plan.model, current["modelVersion"]) if current else None,
        to_archive_sha256=digest)
    old_version = intent.from_version
    registered = next((v for v in versions_of(client, plan.model) if v["modelVersion"] == new_version),
                      None)
    if registered is not None and pending is not None and current is not None \
            and current["modelVersion"] == new_version:
        log(f"{plan.model} {new_version} became the default in an earlier run that stopped "
            "half-way: finishing it")
        drain_old(client, plan, old_version)
        with interrupts_deferred():     # the old version goes and the entry says done together
            unregister_old(client, plan, old_version, log)
            return intent if client.dry_run or journal is None else journal.end(pending, "done")
    if registered is not None:
        check_resumable(plan, registered, old_version)
        if pending is not None and pending.to_archive_sha256 not in (None, digest):
            raise RolloutError(f"{plan.archive} changed since the rollout that registered "
                               f"{plan.model} {new_version} began (its digest differs from the "
                               f"recorded one): undo that rollout with `torchserve-vision models "
                               f"rollout --abort {plan.model}`, then roll the new archive out")
        log(f"{plan.model} {new_version} is already registered as this rollout registers it (an "
            "earlier run stopped half-way): taking up from its workers")
    reference = None
    if plan.compare_with_current and old_version is not None and not client.dry_run:
        reference = client.predict(plan.model, old_version, plan.smoke_image)
    if journal is not None and pending is None and not client.dry_run:
        intent = journal.begin(intent)
    try:
        swap(client, plan, new_version, old_version, reference,
             answer_reader(manifest), log,
             registered=registered is not None)
    except (ManagementError, RolloutError, KeyboardInterrupt) as error:
        raise undone(client, plan.model, new_version, old_version, intent, journal, log,
                     error) from None
    # Once the old version is unregistered there is no undoing: a Ctrl-C from here on takes
    # effect after the entry says done, so a complete rollout is never left recorded `started`
    # and no undo tries to restore a default that is gone.
    with interrupts_deferred():
        try:
            unregister_old(client, plan, old_version, log)
        except ManagementError as error:
            raise undone(client, plan.model, new_version, old_version, intent, journal, log,
                         error) from None
        if journal is not None and intent.state == "started":
            return journal.end(intent, "done")
        return replace(intent, time=now_text())


def undone(client: TorchServeClient, model: str, new_version: str, old_version: str | None,
           intent: HistoryEntry, journal: Journal | None, log: Log,
           error: Exception | KeyboardInterrupt) -> RolloutError:
    """Undo a rollout that failed or was interrupted (`undo`), record it undone when the undo
    was complete, and return the error that says so (RolloutInterrupted for a Ctrl-C)."""
    problems = [] if client.dry_run else undo(client, model, new_version, old_version, log)
    if journal is not None and intent.state == "started" and not problems:
        journal.end(intent, "undone")
    state = f"; undo incomplete: {'; '.join(problems)}" if problems else \
        f" ({model} {old_version} is the default)" if old_version else ""
    if isinstance(error, KeyboardInterrupt):
        return RolloutInterrupted(f"rollout of {model} {new_version} was interrupted and "
                                  f"undone{state}")
    return RolloutError(f"rollout of {model} {new_version} failed and was undone{state}: {error}")


def checked_manifest(store: Path, archive: str, model: str) -> dict[str, Any]:
    """The manifest of the archive in `store`; RolloutError when it cannot be read or holds
    another model."""
    try:
        manifest = archive_manifest(store / archive)
    except ArchiveError as error:
        raise RolloutError(str(error)) from None
    if manifest["modelName"] != model:
        raise RolloutError(f"{archive} holds model {manifest['modelName']!r}, not {model!r}")
    return manifest


def check_resumable(plan: RolloutPlan, registered: dict[str, Any], old_version: str | None) -> None:
    """A rollout whose version is already registered takes up where an earlier run of the same
    rollout stopped (killed after registering it, before it became the default) when that
    version holds the same archive with the same batch settings (its workers are set by the
    next step; its timeouts come from the archive's YAML); RolloutError otherwise, saying what
    differs and what to do."""
    version = registered["modelVersion"]
    if version == old_version:
        raise RolloutError(f"{plan.model} {version} is already registered and is the default: "
                           "nothing to roll out")
    found, wanted = ServingSettings.of_version(registered), plan.settings
    compared = [("archive", registered.get("modelUrl"), plan.archive),
                ("batch size", found.batch_size, wanted.batch_size),
                ("batching", found.batching, wanted.batching)]
    if wanted.batching == DELAYED:
        compared.append(("max batch delay", found.max_batch_delay_ms, wanted.max_batch_delay_ms))
    else:
        compared.append(("deadline (ms)", found.deadline_ms, wanted.deadline_ms))
    differences = [f"{name} {have!r} (this rollout: {want!r})" for name, have, want in compared
                   if have != want]
    if differences:
        raise RolloutError(f"{plan.model} {version} is already registered, with {'; '.join(differences)}: "
                           f"unregister it (models unregister {plan.model} --version {version}) or "
                           "roll out another version")


def swap(client: TorchServeClient, plan: RolloutPlan, new_version: str, old_version: str | None,
         reference: Any | None, top_label: Callable[[Any], str | None], log: Log,
         registered: bool = False) -> None:
    """The rollout's steps that can be undone, from register to the old version drained (see
    `rollout`); `registered`: an earlier run registered the new version already."""
    settings = plan.settings
    if not registered:
        log(f"registering {plan.archive} as {plan.model} {new_version}")
        client.register(plan.archive, settings.batch_size, settings.max_batch_delay_ms,
                        settings.min_workers, settings.response_timeout_s, settings.startup_timeout_s)
    client.scale(plan.model, new_version, settings.min_workers, settings.max_workers)
    wait_for_workers(client, plan.model, new_version, settings.min_workers, plan.workers_deadline_s)
    log(f"{plan.model} {new_version}: {settings.min_workers} worker(s) ready; smoke test")
    smoke_test(client, plan.model, new_version, plan.smoke_image, plan.expect_labels, reference,
               top_label)
    client.set_default(plan.model, new_version)
    log(f"{plan.model} {new_version} is the default")
    drain_old(client, plan, old_version)


def retiring(client: TorchServeClient, plan: RolloutPlan, old_version: str) -> bool:
    """Whether the rollout unregisters the old version: unless the plan keeps it, or it is gone
    already."""
    return not plan.keep_old and \
        any(v["modelVersion"] == old_version for v in versions_of(client, plan.model))


def drain_old(client: TorchServeClient, plan: RolloutPlan, old_version: str | None) -> None:
    """Once the new version is the default: wait until the old one, if it is to be unregistered,
    has no request queued or in a batch (`wait_for_drain`)."""
    if old_version is not None and retiring(client, plan, old_version):
        wait_for_drain(client, plan.model, old_version, plan.drain_timeout_s, plan.drain_grace_s)


def unregister_old(client: TorchServeClient, plan: RolloutPlan, old_version: str | None,
                   log: Log) -> None:
    """Once it has drained, unregister the old version (unless the plan keeps it, or it is gone
    already)."""
    if old_version is not None and retiring(client, plan, old_version):
        client.unregister(plan.model, old_version)
        log(f"unregistered {plan.model} {old_version}")


def settings_text(settings: ServingSettings) -> str:
    deadline = f", deadline {settings.deadline_ms} ms" if settings.deadline_ms else ""
    batching = (f"queued batching{deadline}" if settings.batching == QUEUED
                else f"delay {settings.max_batch_delay_ms} ms")
    return (f"batch {settings.batch_size}, {batching}, workers "
            f"{settings.min_workers}/{settings.max_workers}, timeouts response "
            f"{settings.response_timeout_s} s / start-up {settings.startup_timeout_s} s")


def scale(client: TorchServeClient, model: str, version: str | None, low: int, high: int,
          store: Path, smoke_image: bytes, log: Log, timeout_s: float | None = None,
          journal: Journal | None = None, kind: ChangeKind = "scale") -> HistoryEntry | None:
    """Set a version's workers with no failed request; return a history entry (None: dry run),
    recorded as `kind` in `journal` when one is given.

    TorchServe stops surplus workers even in the middle of a batch (those requests get 500
    "Worker died"), so the default version is scaled down by rolling out a copy of its archive
    (version `<v>-w<N>`) with fewer workers: the old workers finish their queue before they go.
    A server whose model API is off cannot register that copy: refused before any change.
    Anything else is a plain scale call, then a wait for READY workers; if they do not come
    before the deadline, the old counts are restored. A half-done scaling by copy is finished
    by the same command; a half-done change of another kind is refused (see `abort`)."""
    pending = journal.pending(model) if journal is not None else None
    if pending is not None and pending.kind != kind:
        raise RolloutError(half_done_text(pending))
    if pending is not None and pending.to_version != pending.from_version:
        plan = RolloutPlan(model, pending.to_archive, pending.to_settings, smoke_image,
                           workers_timeout_s=timeout_s)
        return rollout(client, plan, store, log, journal, kind)
    current = client.describe(model, version)[0]
    version = str(current["modelVersion"])
    before = ServingSettings.of_version(current)
    after = replace(before, min_workers=low, max_workers=high)
    default = default_version(client, model)
    if low < len(current["workers"]) and default and default["modelVersion"] == version:
        copy_version = f"{version.split('-w')[0]}-w{low}"
        if not client.takes_registrations():
            raise RolloutError(
                f"scaling {model} {version} down from {len(current['workers'])} workers to {low} "
                f"without a failed request registers a copy of its archive with fewer workers "
                f"({copy_version}), and this server's model API is off (enable_model_api=false, as "
                f"in the production config): nothing was changed. Start the server with that many "
                f"workers instead (TSV_WORKERS={low})")
        if client.dry_run:
            log(f"[dry-run] would roll out {model} {copy_version}, a copy of {current['modelUrl']} "
                f"with {settings_text(after)}, then unregister {version}")
            return None
        archive = archive_with_version(store, current["modelUrl"], copy_version)
        plan = RolloutPlan(model, archive, after, smoke_image, workers_timeout_s=timeout_s)
        return rollout(client, plan, store, log, journal, kind)
    if pending is not None and (pending.to_version, pending.to_settings) != (version, after):
        raise RolloutError(half_done_text(pending))
    intent = pending or HistoryEntry(
        kind=kind, model=model, to_version=version, to_archive=current["modelUrl"],
        to_settings=after, from_version=version, from_archive=current["modelUrl"],
        from_settings=before, time=now_text(), server=server_identity(client, model, version))
    if journal is not None and pending is None and not client.dry_run:
        intent = journal.begin(intent)
    try:
        client.scale(model, version, low, high)
        wait_for_workers(client, model, version, low,
                         timeout_s or after.startup_timeout_s + WORKERS_DEADLINE_MARGIN_S)
    except (RolloutError, KeyboardInterrupt) as error:
        with interrupts_ignored():
            client.scale(model, version, before.min_workers, before.max_workers)
            if journal is not None and intent.state == "started":
                journal.end(intent, "undone")
        raise RolloutError(f"scaling {model} {version} to {low} workers failed and was undone "
                           f"(workers {before.min_workers}/{before.max_workers} again): {error!r}") from None
    with interrupts_deferred():     # the workers are there: a Ctrl-C comes after the entry says so
        log(f"{model} {version}: workers min {low} / max {high}")
        if journal is not None and intent.state == "started":
            return journal.end(intent, "done")
        return intent


def rollback(client: TorchServeClient, model: str, journal: Journal, store: Path,
             plan_template: RolloutPlan, log: Log) -> HistoryEntry | None:
    """Undo the latest completed change to what serves `model`: the previous version becomes the
    default again (at once when it is still registered, else by rolling out its archive again
    with its recorded settings), or a scaling is reversed. Says what it will do first. A
    half-done rollback is finished; a half-done change of another kind is refused (see `abort`);
    so is a change recorded on another server than the live one (it was restarted since)."""
    pending = journal.pending(model)
    if pending is not None and pending.kind != "rollback":
        raise RolloutError(half_done_text(pending))
    current = default_version(client, model)
    if current is None:
        raise RolloutError(f"{model} is not registered")
    if pending is not None:
        return finish_rollback(client, pending, journal, store, plan_template, log)
    entry = last_change(journal.history_file, model, current["modelVersion"])
    if entry is None or entry.from_version is None or entry.from_archive is None:
        raise RolloutError(f"no recorded change of {model} to {current['modelVersion']} in "
                           f"{journal.history_file}; nothing to roll back to")
    live_server = server_identity(client, model, current["modelVersion"])
    if entry.server is not None and live_server is not None and entry.server != live_server:
        raise RolloutError(f"the latest recorded change of {model} to {current['modelVersion']} (the "
                           f"{entry.kind} of {entry.time}) was made on another server ({entry.server}; "
                           f"this one is {live_server}): it was restarted since, and nothing "
                           "recorded on this server is left to roll back")
    previous, previous_archive = entry.from_version, entry.from_archive
    settings = entry.from_settings or entry.to_settings
    undoing = f"undoing the {entry.kind} of {entry.time}"
    if previous == current["modelVersion"]:
        log(f"rollback of {model} ({undoing}): {previous} back to {settings_text(settings)}")
        return scale(client, model, previous, settings.min_workers, settings.max_workers, store,
                     plan_template.smoke_image, log, plan_template.workers_timeout_s, journal,
                     "rollback")
    if any(v["modelVersion"] == previous for v in versions_of(client, model)):
        log(f"rollback of {model} ({undoing}): {previous} is still registered; it becomes the "
            f"default again and {current['modelVersion']} stays registered")
        intent = HistoryEntry(kind="rollback", model=model, to_version=previous,
                              to_archive=previous_archive, to_settings=settings,
                              from_version=current["modelVersion"], from_archive=current["modelUrl"],
                              from_settings=ServingSettings.of_version(current), time=now_text(),
                              server=live_server)
        return set_default_journaled(client, intent, journal, log)
    log(f"rollback of {model} ({undoing}): {previous} is gone; re-registering it from "
        f"{previous_archive} with {settings_text(settings)}, then retiring "
        f"{current['modelVersion']}")
    plan = replace(plan_template, model=model, archive=previous_archive, settings=settings)
    return rollout(client, plan, store, log, journal, "rollback")


def set_default_journaled(client: TorchServeClient, intent: HistoryEntry, journal: Journal,
                          log: Log) -> HistoryEntry | None:
    """Make `intent.to_version` the default, recorded in the journal (None: dry run)."""
    if client.dry_run:
        client.set_default(intent.model, intent.to_version)
        return None
    started = journal.begin(intent)
    client.set_default(intent.model, intent.to_version)
    log(f"{intent.model} {intent.to_version} is the default again")
    return journal.end(started, "done")


def finish_rollback(client: TorchServeClient, pending: HistoryEntry, journal: Journal,
                    store: Path, plan_template: RolloutPlan, log: Log) -> HistoryEntry | None:
    """A rollback whose command died half-way, done again from its recorded intent."""
    model = pending.model
    log(f"finishing the rollback of {model} to {pending.to_version} that an earlier run left "
        f"half-done ({pending.time}); {pending.from_version} is retired once it is done")
    if pending.to_version == pending.from_version:
        return scale(client, model, pending.to_version, pending.to_settings.min_workers,
                     pending.to_settings.max_workers, store, plan_template.smoke_image, log,
                     plan_template.workers_timeout_s, journal, "rollback")
    # As a rollout of the recorded archive: its workers are checked and smoke-tested again
    # before it becomes the default, and the version rolled back from is then retired.
    plan = replace(plan_template, model=model, archive=pending.to_archive,
                   settings=pending.to_settings)
    return rollout(client, plan, store, log, journal, "rollback")


def abort(client: TorchServeClient, model: str, journal: Journal, store: Path,
          plan_template: RolloutPlan, log: Log) -> HistoryEntry:
    """Undo the change of `model` that a dead command left half-done: the version it started
    from serves again as it did (re-registered from its archive if it is gone), and the version
    the change brought is unregistered. RolloutError when nothing is half-done."""
    pending = journal.pending(model)
    if pending is None:
        raise RolloutError(f"no half-done change of {model} in {journal.history_file}: nothing "
                           "to abort")
    old, new = pending.from_version, pending.to_version
    log(f"aborting the {pending.kind} of {model} from {old} to {new} started {pending.time}")
    registered = {v["modelVersion"] for v in versions_of(client, model)}
    if old == new and pending.from_settings is not None:
        settings = pending.from_settings
        client.scale(model, old, settings.min_workers, settings.max_workers)
        wait_for_workers(client, model, old, settings.min_workers,
                         plan_template.workers_timeout_s or settings.startup_timeout_s
                         + WORKERS_DEADLINE_MARGIN_S)
    elif old is None or old in registered:
        current = default_version(client, model)
        if old is not None and (current is None or current["modelVersion"] != old):
            client.set_default(model, old)
            log(f"restored {model} {old} as default")
        if new in registered and new != old:
            wait_for_drain(client, model, new, plan_template.drain_timeout_s,
                           plan_template.drain_grace_s)
            client.unregister(model, new)
            log(f"unregistered {model} {new}")
    elif pending.from_archive is not None:
        log(f"{model} {old} is gone: rolling its archive {pending.from_archive} out again")
        plan = replace(plan_template, model=model, archive=pending.from_archive,
                       settings=pending.from_settings or pending.to_settings)
        rollout(client, plan, store, log)
    log(f"aborted: {model} {old} serves as before {pending.time}" if old else
        f"aborted: {model} {new} is unregistered")
    return pending if client.dry_run else journal.end(pending, "aborted")
