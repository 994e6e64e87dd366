"""The rollout history file, which is also the journal of changes: one typed entry per change
to what serves a model (a rollout, a scaling, a rollback). Each change is recorded as `started`
with its intent (what it is about to do and the live state it starts from) before it acts, and
rewritten as `done`, `undone` or `aborted` after. An entry left `started` is a change whose
command died half-way: running the same command again finishes it, `models rollout --abort`
undoes it. `models rollback` undoes the latest `done` change. A JSON list; written whole to a
temporary file and renamed, so an interrupted write never leaves half a file."""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from torchserve_vision.model_descriptions import DELAYED, ServingSettings

ChangeKind = Literal["rollout", "scale", "rollback"]
ChangeState = Literal["started", "done", "undone", "aborted"]


def recorded_settings(value: dict[str, Any]) -> ServingSettings:
    """Settings as an entry records them; entries written before batching was recorded were all
    TorchServe's delayed batching."""
    return ServingSettings(**{"batching": DELAYED, **value})


@dataclass(frozen=True)
class HistoryEntry:
    """`model` went from `from_version` (its archive and settings; None: nothing served it) to
    `to_version`. A scaling keeps the version and changes the settings."""

    kind: ChangeKind
    model: str
    to_version: str
    to_archive: str
    to_settings: ServingSettings
    from_version: str | None
    from_archive: str | None
    from_settings: ServingSettings | None
    time: str
    state: ChangeState = "done"
    server: str | None = None
    id: str = ""
    pid: int | None = None
    # SHA-256 of the archive the change brings, as it was when the change began (None: not
    # recorded, e.g. entries of older files).
    to_archive_sha256: str | None = None

    def as_kind(self, kind: ChangeKind) -> HistoryEntry:
        return replace(self, kind=kind)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> HistoryEntry:
        """An entry as written (entries of older files lack `kind`: rollouts; and the journal's
        fields: done, on an unknown server)."""
        def settings(value: dict[str, Any] | None) -> ServingSettings | None:
            return recorded_settings(value) if value is not None else None

        return cls(kind=raw.get("kind", "rollout"), model=raw["model"], to_version=raw["to_version"],
                   to_archive=raw["to_archive"], to_settings=recorded_settings(raw["to_settings"]),
                   from_version=raw.get("from_version"), from_archive=raw.get("from_archive"),
                   from_settings=settings(raw.get("from_settings")), time=raw["time"],
                   state=raw.get("state", "done"), server=raw.get("server"), id=raw.get("id", ""),
                   pid=raw.get("pid"), to_archive_sha256=raw.get("to_archive_sha256"))


def now_text() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_history(history_file: Path) -> list[HistoryEntry]:
    if not history_file.is_file():
        return []
    return [HistoryEntry.from_json(raw) for raw in json.loads(history_file.read_text())]


def write_history(history_file: Path, history: list[HistoryEntry]) -> None:
    """The whole file is written to a temporary file beside it, then renamed."""
    history_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=history_file.parent, prefix=f".{history_file.name}.",
                                     delete=False) as temporary:
        json.dump([item.to_json() for item in history], temporary, indent=2)
    os.replace(temporary.name, history_file)


def record(history_file: Path, entry: HistoryEntry) -> None:
    """Append `entry`, or put it in the place of the entry with its id (when it has one)."""
    history = read_history(history_file)
    places = [index for index, item in enumerate(history) if entry.id and item.id == entry.id]
    if places:
        history[places[0]] = entry
    else:
        history.append(entry)
    write_history(history_file, history)


def last_change(history_file: Path, model: str, current_version: str) -> HistoryEntry | None:
    """The latest completed change that made `current_version` what serves `model` and that has
    something to go back to; None when there is none."""
    for entry in reversed(read_history(history_file)):
        if (entry.model == model and entry.state == "done" and entry.to_version == current_version
                and entry.from_version):
            return entry
    return None


@dataclass(frozen=True)
class Journal:
    """The history file as the journal of changes in progress (see the module docstring)."""

    history_file: Path

    def begin(self, intent: HistoryEntry) -> HistoryEntry:
        """Record `intent` as started, before acting; returns it as recorded (with its id)."""
        started = replace(intent, state="started", id=uuid.uuid4().hex, pid=os.getpid(),
                          time=now_text())
        record(self.history_file, started)
        return started

    def end(self, entry: HistoryEntry, state: ChangeState) -> HistoryEntry:
        """Rewrite the started `entry` (same id) as `state`, now."""
        ended = replace(entry, state=state, time=now_text())
        record(self.history_file, ended)
        return ended

    def pending(self, model: str) -> HistoryEntry | None:
        """The change of `model` that a dead command left half-done: its latest entry when that
        is still `started`, else None."""
        for entry in reversed(read_history(self.history_file)):
            if entry.model == model:
                return entry if entry.state == "started" else None
        return None


def half_done_text(entry: HistoryEntry) -> str:
    """What a half-done change is, and how to finish or undo it."""
    return (f"a {entry.kind} of {entry.model} from {entry.from_version} to {entry.to_version} "
            f"({entry.to_archive}) is half-done, started {entry.time} by pid {entry.pid}: run the "
            f"same command again to finish it, or `torchserve-vision models rollout --abort "
            f"{entry.model}` to undo it")
