"""The rollout history file and journal: typed entries, written whole, read back as written;
changes recorded as started before they act and rewritten with their outcome after."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from torchserve_vision.cli import main as command
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.rollout_history import (
    CanarySplit,
    HistoryEntry,
    Journal,
    canary_step_to_undo,
    half_done_text,
    last_change,
    read_history,
    record,
)


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


def test_settings_of_older_files_without_batching_are_delayed_batching(tmp_path: Path):
    history = tmp_path / "history.json"
    raw = entry("2.0", "1.0").to_json()
    del raw["to_settings"]["batching"], raw["from_settings"]["batching"]
    history.write_text(json.dumps([raw]))
    (read,) = read_history(history)
    assert read.to_settings.batching == read.from_settings.batching == "delayed"  # type: ignore[union-attr]
    assert entry("2.0", "1.0").to_settings.batching == "queued"    # the default now


def test_a_change_is_recorded_as_started_before_it_acts_and_rewritten_in_place_after(tmp_path: Path):
    history = tmp_path / "history.json"
    journal = Journal(history)
    record(history, entry("1.0", None))
    started = journal.begin(entry("2.0", "1.0"))
    assert (started.state, started.pid) == ("started", os.getpid()) and started.id
    assert read_history(history)[-1] == started            # on disk before the change acts
    assert journal.pending("m") == started
    assert last_change(history, "m", "2.0") is None         # not done: nothing to roll back
    done = journal.end(started, "done")
    assert [item.state for item in read_history(history)] == ["done", "done"]
    assert journal.pending("m") is None
    assert last_change(history, "m", "2.0") == done


@pytest.mark.parametrize("outcome", ["undone", "aborted"])
def test_undone_and_aborted_changes_are_neither_pending_nor_rolled_back(tmp_path: Path, outcome):
    history = tmp_path / "history.json"
    journal = Journal(history)
    journal.end(journal.begin(entry("2.0", "1.0")), outcome)
    assert journal.pending("m") is None
    assert last_change(history, "m", "2.0") is None


def test_only_the_latest_change_of_a_model_can_be_pending(tmp_path: Path):
    journal = Journal(tmp_path / "history.json")
    journal.begin(entry("2.0", "1.0"))                       # its command died ...
    journal.end(journal.begin(entry("3.0", "1.0")), "done")  # ... and it was cleaned up by hand
    assert journal.pending("m") is None
    journal.begin(entry("4.0", "3.0"))
    pending = journal.pending("m")
    assert pending is not None and pending.to_version == "4.0"
    assert journal.pending("other") is None


def test_a_half_done_change_says_how_to_finish_or_undo_it(tmp_path: Path):
    started = Journal(tmp_path / "history.json").begin(entry("2.0", "1.0"))
    text = half_done_text(started)
    assert "from 1.0 to 2.0" in text and f"pid {os.getpid()}" in text
    assert "run the same command again" in text and "models rollout --abort m" in text


def test_entries_of_older_files_are_done_on_an_unknown_server(tmp_path: Path):
    history = tmp_path / "history.json"
    raw = entry("2.0", "1.0").to_json()
    for field in ("state", "server", "id", "pid"):
        del raw[field]
    history.write_text(json.dumps([raw]))
    (read,) = read_history(history)
    assert (read.state, read.server) == ("done", None)


def step(percent: int | None, before: int | None, kind: str = "canary", state: str = "done") -> HistoryEntry:
    """A change of m's split (2.0 the candidate, 1.0 the default) from `before` % to `percent` %
    (None: no split)."""
    def split(value: int | None) -> CanarySplit | None:
        return CanarySplit("2.0", value) if value is not None else None
    return replace(entry("2.0", "1.0", kind), split=split(percent), from_split=split(before),
                   state=state)  # type: ignore[arg-type]


def test_canary_steps_are_read_back_with_their_splits(tmp_path: Path):
    history = tmp_path / "history.json"
    written = [step(10, None), replace(step(None, 10), note="gates failed at 10%")]
    for item in written:
        record(history, item)
    assert read_history(history) == written


def test_rollback_undoes_canary_steps_one_at_a_time_like_an_undo_stack(tmp_path: Path):
    history = tmp_path / "history.json"
    for item in (entry("1.0", "0.9"), step(10, None), step(25, 10), step(50, 25)):
        record(history, item)
    assert canary_step_to_undo(history, "m") == step(50, 25)
    record(history, step(25, 50, "rollback"))
    assert canary_step_to_undo(history, "m") == step(25, 10)
    record(history, step(10, 25, "rollback"))
    assert canary_step_to_undo(history, "m") == step(10, None)
    record(history, step(None, 10, "rollback"))
    assert canary_step_to_undo(history, "m") is None           # the rollout before: a plain rollback's
    assert last_change(history, "m", "1.0") == entry("1.0", "0.9")
    assert canary_step_to_undo(history, "other") is None


def test_a_step_after_a_rollback_of_steps_is_undone_first(tmp_path: Path):
    history = tmp_path / "history.json"
    for item in (step(10, None), step(50, 10), step(10, 50, "rollback"), step(30, 10)):
        record(history, item)
    assert canary_step_to_undo(history, "m") == step(30, 10)
    record(history, step(10, 30, "rollback"))
    assert canary_step_to_undo(history, "m") == step(10, None)


def test_aborted_and_undone_steps_and_changes_after_the_steps_are_passed_by(tmp_path: Path):
    history = tmp_path / "history.json"
    for item in (step(10, None), step(25, 10, state="aborted"), step(50, 25, state="undone")):
        record(history, item)
    assert canary_step_to_undo(history, "m") == step(10, None)
    record(history, entry("2.0", "1.0"))                        # a promotion: a rollout
    assert canary_step_to_undo(history, "m") is None
    assert last_change(history, "m", "2.0") == entry("2.0", "1.0")


def test_canary_steps_are_never_taken_for_a_change_of_the_default(tmp_path: Path):
    history = tmp_path / "history.json"
    record(history, step(10, None))
    assert last_change(history, "m", "2.0") is None


def test_a_half_done_canary_step_says_which_split_abort_restores(tmp_path: Path):
    started = Journal(tmp_path / "history.json").begin(step(25, 10))
    text = half_done_text(started)
    assert "from 10% to 2.0 to 25% to 2.0" in text and "models rollout --abort m" in text
    assert "restores 10% to 2.0" in text


def test_a_dry_run_rollback_leaves_a_half_done_step_rollback_as_it_is(tmp_path: Path, capsys):
    """`models rollback --dry-run` over a rollback of a canary step that a dead command left
    started: it says what it would finish and changes nothing (no server is asked)."""
    history = tmp_path / "history.json"
    Journal(history).begin(step(10, 25, "rollback"))
    assert command(["models", "rollback", "m", "--dry-run", "--history", str(history),
                    "--management-url", "http://127.0.0.1:9"]) == 0
    assert "[dry-run] would finish the rollback of m's canary: 10% to 2.0" in capsys.readouterr().out
    assert [item.state for item in read_history(history)] == ["started"]


def test_a_dry_run_abort_of_a_half_done_step_says_so_and_changes_nothing(tmp_path: Path, capsys):
    history = tmp_path / "history.json"
    Journal(history).begin(step(25, 10))
    assert command(["models", "rollout", "m", "--abort", "--dry-run", "--history", str(history),
                    "--management-url", "http://127.0.0.1:9"]) == 0
    said = capsys.readouterr().out
    assert "[dry-run] would abort the half-done change of m's split (canary): 10% to 2.0 again" in said
    assert [item.state for item in read_history(history)] == ["started"]
