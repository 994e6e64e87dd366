"""When a drain is done: nothing queued or in a batch for five polls in a row; the fixed grace
only where some version's batches cannot be seen."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from torchserve_vision import server_state
from torchserve_vision.server_state import Outstanding, wait_until_answered


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The graces slept (polling pauses go through wait_until's event, not time.sleep)."""
    slept: list[float] = []
    monkeypatch.setattr(server_state.time, "sleep", slept.append)
    return slept


def polls(*states: Outstanding) -> tuple[list[Outstanding], Callable[[], Outstanding]]:
    """A poll function answering `states` in turn, then the last one forever; and what it
    answered."""
    answered: list[Outstanding] = []
    remaining: Iterator[Outstanding] = iter(states)

    def poll() -> Outstanding:
        answered.append(next(remaining, states[-1]))
        return answered[-1]

    return answered, poll


def test_a_batch_still_computed_keeps_the_drain_waiting_and_no_grace_follows(sleeps):
    answered, poll = polls(Outstanding(2), Outstanding(0, in_batch=2), Outstanding(0, in_batch=2),
                           Outstanding(0, in_batch=1), Outstanding(0))
    assert wait_until_answered(poll, timeout_s=30, grace_s=2.0, poll_s=0.001)
    assert answered[3:] == [Outstanding(0, in_batch=1)] + [Outstanding(0)] * 5
    assert sleeps == []


def test_one_busy_poll_among_quiet_ones_starts_the_count_again(sleeps):
    answered, poll = polls(*[Outstanding(0)] * 4, Outstanding(0, in_batch=1), Outstanding(0))
    assert wait_until_answered(poll, timeout_s=30, grace_s=2.0, poll_s=0.001)
    assert len(answered) == 10


def test_unseen_batches_get_the_grace_after_the_queue_empties(sleeps):
    _, poll = polls(Outstanding(1, unseen=1), Outstanding(0, unseen=1))
    assert wait_until_answered(poll, timeout_s=30, grace_s=2.0, poll_s=0.001)
    assert sleeps == [2.0]


def test_continuous_load_times_out_without_the_grace(sleeps):
    _, poll = polls(Outstanding(0, in_batch=1, unseen=1))
    assert not wait_until_answered(poll, timeout_s=0.3, grace_s=2.0, poll_s=0.001)
    assert sleeps == []
