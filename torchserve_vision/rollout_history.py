"""The rollout history file, which is also the journal of changes: one typed entry per change
to what serves a model (a rollout, a scaling, a canary step, a rollback). Each change is recorded as `started`
with its intent (what it is about to do and the live state it starts from) before it acts, and
rewritten as `done`, `undone` or `aborted` after. An entry left `started` is a change whose
command died half-way: running the same command again finishes it, `models rollout --abort`
undoes it. `models rollback` undoes the latest `done` change: canary steps one at a time, back to
the split before each (`canary_step_to_undo`), then rollouts and scalings. A JSON list; written
whole to a temporary file and renamed, so an interrupted write never leaves half a file."""

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

ChangeKind = Literal["rollout", "scale", "canary", "rollback"]
ChangeState = Literal["started", "done", "undone", "aborted"]


def recorded_settings(value: dict[str, Any]) -> ServingSettings:
    """Settings as an entry records them; entries written before batching was recorded were all
    TorchServe's delayed batching."""
    return ServingSettings(**{"batching": DELAYED, **value})


@dataclass(frozen=True)
class CanarySplit:
    """`percent` % (1..100) of a model's unversioned requests answered by `version`."""

    version: str
    percent: int

    def text(self) -> str:
        return f"{self.percent}% to {self.version}"


def split_text(split: CanarySplit | None) -> str:
    return split.text() if split is not None else "no split"


@dataclass(frozen=True)
class HistoryEntry:
    """`model` went from `from_version` (its archive and settings; None: nothing served it) to
    `to_version`. A scaling keeps the version and changes the settings. A canary step (and the
    rollback of one) changes the split from `from_split` to `split` (None: no split); its
    `to_version` is the candidate, its `from_version` the default, which stays the default."""

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
    split: CanarySplit | None = None
    from_split: CanarySplit | None = None
    note: str | None = None   # why, where the command says (a canary's failed gates)

    @property
    def changes_split(self) -> bool:
        return self.kind == "canary" or self.split is not None or self.from_split is not None

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

        def split(value: dict[str, Any] | None) -> CanarySplit | None:
            return CanarySplit(**value) if value is not None else None

        return cls(kind=raw.get("kind", "rollout"), model=raw["model"], to_version=raw["to_version"],
                   to_archive=raw["to_archive"], to_settings=recorded_settings(raw["to_settings"]),
                   from_version=raw.get("from_version"), from_archive=raw.get("from_archive"),
                   from_settings=settings(raw.get("from_settings")), time=raw["time"],
                   state=raw.get("state", "done"), server=raw.get("server"), id=raw.get("id", ""),
                   pid=raw.get("pid"), to_archive_sha256=raw.get("to_archive_sha256"),
                   split=split(raw.get("split")), from_split=split(raw.get("from_split")),
                   note=raw.get("note"))


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
    something to go back to; None when there is none. Canary steps and their rollbacks change
    the split, not what the default is: see `canary_step_to_undo`."""
    for entry in reversed(read_history(history_file)):
        if (entry.model == model and entry.state == "done" and entry.to_version == current_version
                and entry.from_version and not entry.changes_split):
            return entry
    return None


def canary_step_to_undo(history_file: Path, model: str) -> HistoryEntry | None:
    """The canary step of `model` that `models rollback` undoes next: the latest `done` one not
    already undone by a later rollback (each rollback of a step undoes one, like an undo stack);
    None when a rollout, scaling or plain rollback came after the latest such step (that is
    what a rollback undoes then) or there is none."""
    undone = 0
    for entry in reversed(read_history(history_file)):
        if entry.model != model or entry.state != "done":
            continue
        if entry.kind == "rollback" and entry.changes_split:
            undone += 1
        elif entry.kind == "canary" and undone:
            undone -= 1
        else:
            return entry if entry.kind == "canary" else None
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
    if entry.changes_split:
        return (f"a {entry.kind} of {entry.model}'s canary from {split_text(entry.from_split)} to "
                f"{split_text(entry.split)} is half-done, started {entry.time} by pid {entry.pid}: "
                f"`torchserve-vision models rollout --abort {entry.model}` restores "
                f"{split_text(entry.from_split)}" + (" (`models rollback` finishes it)"
                                                     if entry.kind == "rollback" else ""))
    return (f"a {entry.kind} of {entry.model} from {entry.from_version} to {entry.to_version} "
            f"({entry.to_archive}) is half-done, started {entry.time} by pid {entry.pid}: run the "
            f"same command again to finish it, or `torchserve-vision models rollout --abort "
            f"{entry.model}` to undo it")
