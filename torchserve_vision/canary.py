"""The canary split: a share of a model's unversioned requests answered by a candidate version,
done by the front (HAProxy, `server run --front-port`; torchserve_vision.front_proxy).

The split lives in two HAProxy maps in the server's traffic directory (model -> candidate
version, model -> percent). `set_canary` changes them through HAProxy's runtime API on the
admin socket there (no reload: open connections and requests in flight are untouched) and
rewrites the files (a restarted front keeps the split). Widening a split writes the version
before the percent and narrowing it the percent before the version, so no request is ever sent
to a version the maps do not name. A client that sends `X-Canary-Key` is placed by the key's
hash: the same key always gets the same side while the percent stays, and stays on the
candidate as the percent grows.

Every change of the split is a `canary` entry of the rollout history (started before, done
after; torchserve_vision.rollout_history), so `models rollback` undoes the steps one at a time
(`undo_canary_step`) and a command that died half-way is finished or undone like a rollout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from torchserve_vision.client import ManagementError, TorchServeClient
from torchserve_vision.errors import CommandError
from torchserve_vision.front_proxy import (
    ADMIN_SOCKET,
    CANARY_PERCENT_MAP,
    CANARY_VERSION_MAP,
    REQUEST_LOG_SOCKET,
    traffic_socket,
)
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.rollout import (
    RolloutInterrupted,
    interrupts_deferred,
    interrupts_ignored,
    server_identity,
)
from torchserve_vision.rollout_history import (
    CanarySplit,
    ChangeKind,
    ChangeState,
    HistoryEntry,
    Journal,
    now_text,
    record,
    split_text,
)
from torchserve_vision.server_state import default_version, versions_of
from torchserve_vision.shadow import ShadowTotals


class CanaryError(CommandError, RuntimeError):
    """The split could not be read or changed; the message says why."""


def admin_command(traffic_dir: Path, command: str, timeout_s: float = 5.0) -> str:
    """One command on the front's admin socket; its answer."""
    path = traffic_socket(traffic_dir, ADMIN_SOCKET)
    if not path.exists():
        raise CanaryError(f"no front serves this server ({path} is missing): a canary needs "
                          "`torchserve-vision server run --probe-port P --front-port F`, and its "
                          "clients on the front's port")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout_s)
        try:
            connection.connect(str(path))
            connection.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := connection.recv(65536):
                chunks.append(chunk)
        except OSError as error:
            raise CanaryError(f"the front's admin socket {path}: {error}") from None
    return b"".join(chunks).decode(errors="replace")


def live_map(traffic_dir: Path, name: str) -> dict[str, str]:
    """A map as the running front holds it (`show map`: `<id> <key> <value>` per line)."""
    entries = {}
    for line in admin_command(traffic_dir, f"show map {traffic_dir / name}").splitlines():
        fields = line.split()
        if len(fields) == 3:
            entries[fields[1]] = fields[2]
    return entries


def set_entry(traffic_dir: Path, name: str, key: str, value: str | None) -> None:
    """Set (None: remove) one key of a map, in the running front and in its file."""
    path = traffic_dir / name
    admin_command(traffic_dir, f"del map {path} {key}")   # "Key not found." when absent: fine
    if value is not None:
        answer = admin_command(traffic_dir, f"add map {path} {key} {value}").strip()
        if answer:
            raise CanaryError(f"the front refused {key} -> {value} in {name}: {answer}")
    entries = {k: v for k, v in (line.split(maxsplit=1) for line in
                                 path.read_text(encoding="utf-8").splitlines() if line.strip())}
    entries.pop(key, None)
    if value is not None:
        entries[key] = value
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(f"{k} {v}\n" for k, v in entries.items()), encoding="utf-8")
    os.replace(partial, path)


def set_canary(traffic_dir: Path, model: str, version: str, percent: int) -> None:
    """`percent` % (1..100) of `model`'s unversioned requests to `version`."""
    if not 0 < percent <= 100:
        raise CanaryError(f"the canary percent must be in (0, 100], got {percent}")
    set_entry(traffic_dir, CANARY_VERSION_MAP, model, version)
    set_entry(traffic_dir, CANARY_PERCENT_MAP, model, str(percent))


def remove_canary(traffic_dir: Path, model: str) -> None:
    """No split: the default version answers every unversioned request of `model`."""
    set_entry(traffic_dir, CANARY_PERCENT_MAP, model, None)
    set_entry(traffic_dir, CANARY_VERSION_MAP, model, None)


def apply_split(traffic_dir: Path, model: str, split: CanarySplit | None) -> None:
    if split is None:
        remove_canary(traffic_dir, model)
    else:
        set_canary(traffic_dir, model, split.version, split.percent)


def canary_of(traffic_dir: Path, model: str) -> CanarySplit | None:
    """`model`'s split in the running front; None: no split."""
    percent = live_map(traffic_dir, CANARY_PERCENT_MAP).get(model)
    version = live_map(traffic_dir, CANARY_VERSION_MAP).get(model)
    return CanarySplit(version, int(percent)) if percent is not None and version is not None else None


# --- the split's changes, in the rollout history -------------------------------------------------
def described(client: TorchServeClient, model: str, version: str) -> dict[str, Any] | None:
    try:
        return client.describe(model, version)[0]
    except (ManagementError, IndexError):
        return None


def split_entry(client: TorchServeClient, model: str, kind: ChangeKind, split: CanarySplit | None,
                from_split: CanarySplit | None, note: str | None = None) -> HistoryEntry:
    """The history entry of a change of `model`'s split (not recorded yet): `to_version` is the
    candidate, `from_version` the default version."""
    stable = default_version(client, model)
    if stable is None:
        raise CanaryError(f"{model} is not registered")
    version = (split or from_split or CanarySplit(stable["modelVersion"], 0)).version
    candidate = described(client, model, version) or {}
    stable_settings = ServingSettings.of_version(stable)
    return HistoryEntry(
        kind=kind, model=model, to_version=version,
        to_archive=str(candidate.get("modelUrl", "")),
        to_settings=ServingSettings.of_version(candidate) if candidate else stable_settings,
        from_version=stable["modelVersion"], from_archive=stable["modelUrl"],
        from_settings=stable_settings, time=now_text(),
        server=server_identity(client, model, stable["modelVersion"]), split=split,
        from_split=from_split, note=note)


def change_split(client: TorchServeClient, journal: Journal, traffic_dir: Path, model: str,
                 split: CanarySplit | None, kind: ChangeKind = "canary",
                 recorded_from: CanarySplit | None = None, note: str | None = None
                 ) -> HistoryEntry | None:
    """Set `model`'s split (None: remove it), recorded as a `kind` entry: started before, done
    after. `recorded_from`: the split the entry says it left (default: the live one). None when
    the split already is `split` (nothing recorded)."""
    before = canary_of(traffic_dir, model)
    if before == split:
        return None
    entry = split_entry(client, model, kind, split, recorded_from or before, note)
    with interrupts_deferred():    # a Ctrl-C comes after the entry says what was done
        intent = journal.begin(entry)
        try:
            apply_split(traffic_dir, model, split)
        except CanaryError:
            try:
                apply_split(traffic_dir, model, before)
                journal.end(intent, "undone")
            except CanaryError:
                pass   # left started: half-done, `models rollout --abort` restores `before`
            raise
        return journal.end(intent, "done")


def undo_canary_step(client: TorchServeClient, step: HistoryEntry, traffic_dir: Path,
                     journal: Journal, log: Callable[[str], None]) -> HistoryEntry | None:
    """`models rollback` of a canary step (rollout_history.canary_step_to_undo): the split
    before it again, recorded as a rollback (None: dry run). Refused when the front's split is
    not what the step left (changed outside the history, or the server restarted) or the
    version it goes back to is gone."""
    model, live = step.model, canary_of(traffic_dir, step.model)
    if live != step.split:
        raise CanaryError(f"the latest canary step of {model} ({step.time}) left "
                          f"{split_text(step.split)}, but the front has {split_text(live)}: it was "
                          "changed outside the history; set the split with `models canary`")
    live_server = server_identity(client, model, step.from_version or "")
    if step.server is not None and live_server is not None and step.server != live_server:
        raise CanaryError(f"the canary step of {model} of {step.time} was made on another server "
                          f"({step.server}; this one is {live_server}): nothing to roll back")
    target = step.from_split
    if target is not None and target.version not in {v["modelVersion"] for v in
                                                      versions_of(client, model)}:
        raise CanaryError(f"the canary step of {step.time} came from {split_text(target)}, and "
                          f"{model} {target.version} is no longer registered")
    log(f"rollback of {model} (undoing the canary step of {step.time}): "
        f"{split_text(step.split)} -> {split_text(target)}")
    if client.dry_run:
        return None
    return change_split(client, journal, traffic_dir, model, target, kind="rollback")


def settle_split_change(pending: HistoryEntry, traffic_dir: Path, journal: Journal,
                        finish: bool) -> HistoryEntry:
    """A change of the split that a dead command left `started`: finished (its split applied,
    done) or undone (the split before it, aborted)."""
    apply_split(traffic_dir, pending.model, pending.split if finish else pending.from_split)
    return journal.end(pending, "done" if finish else "aborted")


def promote_canary(client: TorchServeClient, model: str, traffic_dir: Path, journal: Journal,
                   log: Callable[[str], None]) -> HistoryEntry:
    """The canary's version becomes the default (every unversioned request), the split is
    removed, and the previous default stays registered on standby: `models rollback` makes it
    the default again at once. Recorded in the history as a rollout."""
    split = canary_of(traffic_dir, model)
    stable = default_version(client, model)
    if split is None or stable is None:
        raise CanaryError(f"{model} has no canary to promote")
    version = split.version
    candidate = client.describe(model, version)[0]
    intent = journal.begin(HistoryEntry(
        kind="rollout", model=model, to_version=version, to_archive=candidate["modelUrl"],
        to_settings=ServingSettings.of_version(candidate), from_version=stable["modelVersion"],
        from_archive=stable["modelUrl"], from_settings=ServingSettings.of_version(stable),
        time=now_text(), server=server_identity(client, model, stable["modelVersion"]),
        note=f"promoted from the canary ({split.text()})"))
    client.set_default(model, version)
    log(f"{model} {version} is the default; {stable['modelVersion']} stays registered for rollback")
    remove_canary(traffic_dir, model)
    return journal.end(intent, "done")


# --- the stepped walk (`--steps ... --auto`) ------------------------------------------------------
@dataclass(frozen=True)
class AnsweredRequest:
    """One request the front answered, from its request log: the model it was for, the canary
    version it was sent to (None: the stable default), its status (HAProxy's, -1 when the client
    went away) and the milliseconds it was active."""

    model: str
    canary_version: str | None
    status: int
    active_ms: float


def parse_request_line(line: str) -> AnsweredRequest | None:
    """`<model> <canary version> <status> <ms>` (HAProxy writes `-` for an unset variable); None
    for a request that was not for a model's default version or a malformed line."""
    fields = line.split()
    if len(fields) != 4 or fields[0] == "-":
        return None
    try:
        return AnsweredRequest(fields[0], None if fields[1] == "-" else fields[1], int(fields[2]),
                               float(fields[3]))
    except ValueError:
        return None


class RequestLog:
    """The front's request log for the length of the block: a datagram socket in the traffic
    directory where HAProxy sends one line per answered request (front_proxy.REQUEST_LOG_SOCKET)."""

    def __init__(self, traffic_dir: Path) -> None:
        self.path = traffic_socket(traffic_dir, REQUEST_LOG_SOCKET)
        self.records: list[AnsweredRequest] = []
        self.lock = threading.Lock()
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self.receive, daemon=True)

    def __enter__(self) -> RequestLog:
        self.path.unlink(missing_ok=True)
        self.connection.bind(str(self.path))
        self.thread.start()
        return self

    def receive(self) -> None:
        while True:
            try:
                data = self.connection.recv(4096)
            except OSError:
                return
            if not data and self.closing.is_set():
                return                           # woken by the shutdown in __exit__
            record = parse_request_line(data.decode(errors="replace"))
            if record is not None:
                with self.lock:
                    self.records.append(record)

    def take(self) -> list[AnsweredRequest]:
        """The requests logged since the last call."""
        with self.lock:
            taken, self.records = self.records, []
        return taken

    def __exit__(self, *exc: object) -> None:
        # close() alone would leave the thread blocked in recv() for good (one thread per block
        # left behind); shutdown() wakes it with an empty read.
        self.closing.set()
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=5)
        self.connection.close()
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Gates:
    """What the candidate must show at each step, against the stable version over the same window:
    a failure (non-2xx) rate at most `max_failure_increase` above the stable one, a p99 at most
    `max_p99_ratio` x the stable one + `p99_slack_ms`, and at least `min_requests` requests."""

    max_failure_increase: float = 0.01
    max_p99_ratio: float = 1.5
    p99_slack_ms: float = 25.0
    min_requests: int = 20
    # With a shadow of the same candidate running: its top-1 / box agreement with production
    # over the step's window at least this (None: not a gate).
    min_agreement: float | None = None


@dataclass(frozen=True)
class SideStats:
    requests: int
    failure_rate: float
    p99_ms: float

    @classmethod
    def of(cls, records: Sequence[AnsweredRequest]) -> SideStats:
        if not records:
            return cls(0, 0.0, 0.0)
        failures = sum(not 200 <= record.status < 300 for record in records)
        return cls(len(records), failures / len(records),
                   float(np.percentile([record.active_ms for record in records], 99)))

    def text(self) -> str:
        return f"{self.requests} requests, {100 * self.failure_rate:.1f}% failed, p99 {self.p99_ms:.0f} ms"


def gate_failures(stable: SideStats, candidate: SideStats, gates: Gates,
                  agreement: float | None = None) -> list[str]:
    """Why the candidate may not go on (empty: it may). `agreement`: the shadow's over the window
    (None: no copy was compared)."""
    reasons = []
    if gates.min_agreement is not None and agreement is not None and agreement < gates.min_agreement:
        reasons.append(f"its answers agreed with production's on {agreement:.3f} of the shadowed "
                       f"requests (at least {gates.min_agreement:g} needed)")
    if candidate.requests < gates.min_requests:
        reasons.append(f"only {candidate.requests} requests reached it (at least "
                       f"{gates.min_requests} are needed to judge)")
    if candidate.failure_rate > stable.failure_rate + gates.max_failure_increase:
        reasons.append(f"{100 * candidate.failure_rate:.1f}% of its requests failed against "
                       f"{100 * stable.failure_rate:.1f}% of the stable version's")
    if candidate.p99_ms > stable.p99_ms * gates.max_p99_ratio + gates.p99_slack_ms:
        reasons.append(f"its p99 is {candidate.p99_ms:.0f} ms against {stable.p99_ms:.0f} ms")
    return reasons


class CanaryAborted(CanaryError):
    """A step's gates failed: the split was removed, the stable version answers everything."""


def end_walk(journal: Journal, walked: Sequence[HistoryEntry], state: ChangeState,
             note: str) -> None:
    """The walk's steps rewritten as `state`: no longer what serves, so `models rollback`
    passes them by."""
    for step in walked:
        record(journal.history_file, replace(step, state=state, note=note))


def walk_canary(client: TorchServeClient, model: str, version: str, traffic_dir: Path,
                steps: Sequence[int], hold_s: float, gates: Gates, journal: Journal,
                log: Callable[[str], None],
                shadow_totals: Callable[[], ShadowTotals] | None = None) -> HistoryEntry:
    """Each step's percent for `hold_s`, the candidate judged against the stable version over the
    same window (at 100%, against the last window the stable version answered in); promoted
    after the last step. Each step is a canary entry of the history. At the first failed gate
    the walk's steps are rewritten as aborted (with the reasons) and the split before the walk
    is restored (removed when it was this candidate's: that removal is a step of its own);
    CanaryAborted. Ctrl-C restores the split before the walk and rewrites its steps as undone.
    `shadow_totals()`: the shadow's counters for this candidate so far, for the agreement gate."""
    baseline = SideStats(0, 0.0, 0.0)
    totals = shadow_totals or (lambda: ShadowTotals(0.0, 0.0, 0.0))
    before_walk = canary_of(traffic_dir, model)
    walked: list[HistoryEntry] = []
    with RequestLog(traffic_dir) as requests_log:
        try:
            for percent in steps:
                with interrupts_deferred():   # a step taken is a step the walk knows to undo
                    step = change_split(client, journal, traffic_dir, model,
                                        CanarySplit(version, percent))
                    walked += [step] if step is not None else []
                requests_log.take()
                before = totals()
                time.sleep(hold_s)
                window = [r for r in requests_log.take() if r.model == model]
                after = totals()
                agreement = ((after.agreed - before.agreed) / (after.compared - before.compared)
                             if after.compared > before.compared else None)
                stable = SideStats.of([r for r in window if r.canary_version is None])
                candidate = SideStats.of([r for r in window if r.canary_version == version])
                if stable.requests >= gates.min_requests:
                    baseline = stable
                shadowed = f"; shadow agreement {agreement:.3f}" if agreement is not None else ""
                log(f"{percent}% to {version}: candidate {candidate.text()}; stable "
                    f"{stable.text()}{shadowed}")
                failures = gate_failures(baseline, candidate, gates, agreement)
                if failures:
                    note = f"gates failed at {percent}%: {'; '.join(failures)}"
                    abort_walk(client, journal, traffic_dir, model, walked, before_walk, version, note)
                    raise CanaryAborted(f"the canary of {model} {version} stopped at {percent}% and "
                                        f"was removed: {'; '.join(failures)}")
        except KeyboardInterrupt:
            with interrupts_ignored():
                apply_split(traffic_dir, model, before_walk)
                end_walk(journal, walked, "undone", "interrupted")
            raise RolloutInterrupted(f"the canary of {model} {version} was interrupted; "
                                     f"{split_text(before_walk)} again") from None
    return promote_canary(client, model, traffic_dir, journal, log)


def abort_walk(client: TorchServeClient, journal: Journal, traffic_dir: Path, model: str,
               walked: Sequence[HistoryEntry], before_walk: CanarySplit | None, version: str,
               note: str) -> None:
    """A failed gate: the walk's steps aborted; the split before the walk again, unless it was
    this candidate's (then no split, recorded as a step from it)."""
    with interrupts_ignored():
        end_walk(journal, walked, "aborted", note)
        if before_walk is not None and before_walk.version == version:
            change_split(client, journal, traffic_dir, model, None, recorded_from=before_walk,
                         note=note)
        else:
            apply_split(traffic_dir, model, before_walk)
