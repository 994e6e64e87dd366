"""The stepped canary's judgement (torchserve_vision/canary.py): the front's request log lines,
each side's figures over a window, and the gates."""

from __future__ import annotations

import socket

import pytest

from torchserve_vision.canary import (
    AnsweredRequest,
    Gates,
    RequestLog,
    SideStats,
    gate_failures,
    parse_request_line,
)
from torchserve_vision.waiting import wait_until


def test_a_request_log_line_says_which_side_answered():
    assert parse_request_line("m 2.0 200 17\n") == AnsweredRequest("m", "2.0", 200, 17.0)
    assert parse_request_line("m - 503 4") == AnsweredRequest("m", None, 503, 4.0)
    assert parse_request_line("- - 200 1") is None          # not a model's default version
    assert parse_request_line("m 2.0 two 1") is None and parse_request_line("") is None


def test_the_request_log_receives_the_fronts_lines_and_its_thread_ends_with_the_block(tmp_path):
    """Lines sent to the log's socket as HAProxy sends them (one datagram each, an empty one
    ignored); when the block ends its receiving thread ends too, its socket file is gone."""
    with RequestLog(tmp_path) as log, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as front:
        for line in (b"m 2.0 200 17\n", b"", b"m - 503 4\n"):
            front.sendto(line, str(log.path))
        taken: list[AnsweredRequest] = []

        def both_logged() -> bool:
            taken.extend(log.take())
            return len(taken) == 2

        wait_until(both_logged, 10, "two logged requests", interval_s=0.01)
        assert log.thread.is_alive()
    assert taken == [AnsweredRequest("m", "2.0", 200, 17.0), AnsweredRequest("m", None, 503, 4.0)]
    assert not log.thread.is_alive() and not log.path.exists()


def test_side_figures_count_every_non_2xx_as_a_failure():
    records = [AnsweredRequest("m", None, status, float(ms))
               for status, ms in [(200, 10), (200, 20), (413, 5), (503, 1), (-1, 30)]]
    stats = SideStats.of(records)
    assert (stats.requests, stats.failure_rate) == (5, pytest.approx(0.6))
    assert 29 < stats.p99_ms <= 30
    assert SideStats.of([]) == SideStats(0, 0.0, 0.0)


GATES = Gates(max_failure_increase=0.01, max_p99_ratio=1.5, p99_slack_ms=25.0, min_requests=20)
STABLE = SideStats(200, 0.0, 60.0)


def test_a_candidate_like_the_stable_version_passes():
    assert gate_failures(STABLE, SideStats(40, 0.0, 80.0), GATES) == []


@pytest.mark.parametrize("candidate, reason", [
    (SideStats(40, 0.05, 60.0), "failed"),
    (SideStats(40, 0.0, 116.0), "p99"),            # 60 x 1.5 + 25 = 115
    (SideStats(19, 0.0, 60.0), "requests"),
])
def test_each_gate_stops_the_walk_with_its_reason(candidate, reason):
    (failure,) = gate_failures(STABLE, candidate, GATES)
    assert reason in failure


def test_the_shadows_agreement_is_a_gate_only_when_asked_for_and_measured():
    asked = Gates(min_agreement=0.95)
    candidate = SideStats(40, 0.0, 60.0)
    (failure,) = gate_failures(STABLE, candidate, asked, agreement=0.9)
    assert "agreed" in failure
    assert gate_failures(STABLE, candidate, asked, agreement=0.97) == []
    assert gate_failures(STABLE, candidate, asked, agreement=None) == []     # nothing compared
    assert gate_failures(STABLE, candidate, GATES, agreement=0.1) == []     # not a gate
