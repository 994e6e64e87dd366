"""The rollout history file: one typed entry per change to what serves a model (a rollout, a
scaling, a rollback), so that `models rollback` knows what to undo. A JSON list; written whole
to a temporary file and renamed, so an interrupted write never leaves half a file."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from torchserve_vision.model_descriptions import ServingSettings

ChangeKind = Literal["rollout", "scale", "rollback"]


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

    def as_kind(self, kind: ChangeKind) -> HistoryEntry:
        return replace(self, kind=kind)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> HistoryEntry:
        """An entry as written (entries of older files lack `kind`: rollouts)."""
        def settings(value: dict[str, Any] | None) -> ServingSettings | None:
            return ServingSettings(**value) if value is not None else None

        return cls(kind=raw.get("kind", "rollout"), model=raw["model"], to_version=raw["to_version"],
                   to_archive=raw["to_archive"], to_settings=ServingSettings(**raw["to_settings"]),
                   from_version=raw.get("from_version"), from_archive=raw.get("from_archive"),
                   from_settings=settings(raw.get("from_settings")), time=raw["time"])


def now_text() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_history(history_file: Path) -> list[HistoryEntry]:
    if not history_file.is_file():
        return []
    return [HistoryEntry.from_json(raw) for raw in json.loads(history_file.read_text())]


def record(history_file: Path, entry: HistoryEntry) -> None:
    """Append `entry`: the whole file is written to a temporary file beside it, then renamed."""
    history = [*read_history(history_file), entry]
    history_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=history_file.parent, prefix=f".{history_file.name}.",
                                     delete=False) as temporary:
        json.dump([item.to_json() for item in history], temporary, indent=2)
    os.replace(temporary.name, history_file)


def last_change(history_file: Path, model: str, current_version: str) -> HistoryEntry | None:
    """The latest recorded change that made `current_version` what serves `model` and that has
    something to go back to; None when there is none."""
    for entry in reversed(read_history(history_file)):
        if entry.model == model and entry.to_version == current_version and entry.from_version:
            return entry
    return None
