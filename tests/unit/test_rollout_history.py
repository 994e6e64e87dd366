"""The rollout history file: typed entries, written whole, read back as written."""

from __future__ import annotations

import json
from pathlib import Path

from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.rollout_history import HistoryEntry, last_change, read_history, record


def entry(to_version: str, from_version: str | None, kind: str = "rollout") -> HistoryEntry:
    return HistoryEntry(kind=kind, model="m", to_version=to_version, to_archive=f"m-{to_version}.mar",  # type: ignore[arg-type]
                        to_settings=ServingSettings(batch_size=4), from_version=from_version,
                        from_archive=f"m-{from_version}.mar" if from_version else None,
                        from_settings=ServingSettings() if from_version else None, time="t")


def test_entries_are_read_back_as_written(tmp_path: Path):
    history = tmp_path / "run" / "history.json"
    written = [entry("1.0", None), entry("2.0", "1.0"), entry("2.0", "2.0", "scale")]
    for item in written:
        record(history, item)
    assert read_history(history) == written
    assert [path.name for path in history.parent.iterdir()] == ["history.json"]  # no temporary left


def test_the_last_change_to_the_serving_version_is_the_one_to_undo(tmp_path: Path):
    history = tmp_path / "history.json"
    for item in (entry("1.0", None), entry("2.0", "1.0"), entry("3.0", "2.0")):
        record(history, item)
    assert last_change(history, "m", "3.0") == entry("3.0", "2.0")
    assert last_change(history, "m", "1.0") is None       # nothing before it
    assert last_change(history, "other", "3.0") is None
    assert last_change(tmp_path / "missing.json", "m", "3.0") is None


def test_entries_of_older_files_without_a_kind_are_rollouts(tmp_path: Path):
    history = tmp_path / "history.json"
    raw = entry("2.0", "1.0").to_json()
    del raw["kind"]
    history.write_text(json.dumps([raw]))
    assert read_history(history) == [entry("2.0", "1.0")]
