"""Ctrl-C and the canary's record (torchserve_vision/canary.py, rollout.interrupts_deferred): a
split change and its history entry happen together, so a Ctrl-C that lands just after a walk's
step changed the split still finds the step among those it rewrites as undone. The front is
replaced by a dictionary (the split) and the management API by a fixed entry; the history file,
the request log socket and the signals are real."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.ctrl_c import interrupt_now
from torchserve_vision import canary
from torchserve_vision.canary import CanaryError, Gates, change_split, walk_canary
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.rollout import RolloutInterrupted, interrupts_deferred, interrupts_ignored
from torchserve_vision.rollout_history import CanarySplit, ChangeState, HistoryEntry, Journal, read_history

MODEL, CANDIDATE = "m", "2.0"


pytestmark = pytest.mark.usefixtures("ctrl_c_raises")


def test_a_ctrl_c_inside_a_deferred_block_is_raised_as_it_ends():
    finished = []
    with pytest.raises(KeyboardInterrupt), interrupts_deferred():
        interrupt_now()
        finished.append("inner")
        with interrupts_deferred():      # nested: only the outermost raises
            interrupt_now()
            finished.append("nested")
        finished.append("after nested")
    assert finished == ["inner", "nested", "after nested"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_deferred_block_without_ctrl_c_or_under_ignored_ones_raises_nothing():
    with interrupts_deferred():
        pass
    with interrupts_ignored(), interrupts_deferred():
        interrupt_now()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class FakeFront:
    """The split as the front holds it; `interrupt_after` a split is applied, a Ctrl-C lands."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, split: CanarySplit | None,
                 interrupt_after: CanarySplit | None = None, fail: CanarySplit | None = None) -> None:
        self.split, self.interrupt_after, self.fail = split, interrupt_after, fail
        monkeypatch.setattr(canary, "canary_of", lambda traffic_dir, model: self.split)
        monkeypatch.setattr(canary, "apply_split", self.apply)
        monkeypatch.setattr(canary, "split_entry", self.entry)

    def apply(self, traffic_dir: Path, model: str, split: CanarySplit | None) -> None:
        if split is not None and split == self.fail:
            raise CanaryError("the front refused it")
        self.split = split
        if split is not None and split == self.interrupt_after:
            interrupt_now()     # Python runs the handler at once: between two of our lines

    @staticmethod
    def entry(client: object, model: str, kind: str, split: CanarySplit | None,
              from_split: CanarySplit | None, note: str | None = None) -> HistoryEntry:
        return HistoryEntry(kind=kind, model=model, to_version=CANDIDATE, to_archive="",  # type: ignore[arg-type]
                            to_settings=ServingSettings(), from_version="1.0", from_archive="",
                            from_settings=ServingSettings(), time="", split=split,
                            from_split=from_split, note=note)


def history(tmp_path: Path) -> list[tuple[str, CanarySplit | None]]:
    return [(entry.state, entry.split) for entry in read_history(tmp_path / "history.json")]


class JournalInterruptedAtEnd(Journal):
    """A Ctrl-C lands as a step's entry is being ended: the split has changed, the record not."""

    def end(self, entry: HistoryEntry, state: ChangeState) -> HistoryEntry:
        interrupt_now()
        return super().end(entry, state)


@pytest.mark.parametrize("journal, interrupt_after", [
    (JournalInterruptedAtEnd, None),                   # after the maps changed (seen in a run)
    (Journal, CanarySplit(CANDIDATE, 50)),             # as the maps change
], ids=["as-the-step-is-recorded", "as-the-split-changes"])
def test_a_ctrl_c_just_after_a_walks_step_changed_the_split_undoes_that_step(
        tmp_path, monkeypatch, journal, interrupt_after):
    front = FakeFront(monkeypatch, CanarySplit(CANDIDATE, 10), interrupt_after=interrupt_after)
    with pytest.raises(RolloutInterrupted):
        walk_canary(None, MODEL, CANDIDATE, tmp_path, [50, 100], hold_s=60, gates=Gates(),  # type: ignore[arg-type]
                    journal=journal(tmp_path / "history.json"), log=lambda line: None)
    assert front.split == CanarySplit(CANDIDATE, 10)
    assert history(tmp_path) == [("undone", CanarySplit(CANDIDATE, 50))]    # rewritten in place


def test_a_single_change_interrupted_as_it_is_made_is_recorded_done_before_the_ctrl_c(tmp_path, monkeypatch):
    front = FakeFront(monkeypatch, None, interrupt_after=CanarySplit(CANDIDATE, 10))
    journal = Journal(tmp_path / "history.json")
    with pytest.raises(KeyboardInterrupt):
        change_split(None, journal, tmp_path, MODEL, CanarySplit(CANDIDATE, 10))  # type: ignore[arg-type]
    assert front.split == CanarySplit(CANDIDATE, 10)
    assert history(tmp_path) == [("done", CanarySplit(CANDIDATE, 10))]
    assert journal.pending(MODEL) is None


def test_a_change_the_front_refuses_is_recorded_undone(tmp_path, monkeypatch):
    front = FakeFront(monkeypatch, CanarySplit(CANDIDATE, 10), fail=CanarySplit(CANDIDATE, 50))
    with pytest.raises(CanaryError):
        change_split(None, Journal(tmp_path / "history.json"), tmp_path, MODEL,  # type: ignore[arg-type]
                     CanarySplit(CANDIDATE, 50))
    assert front.split == CanarySplit(CANDIDATE, 10)
    assert history(tmp_path) == [("undone", CanarySplit(CANDIDATE, 50))]
