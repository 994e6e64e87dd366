from __future__ import annotations

import pytest

from handlers.batching import decode_each, merge_outcomes
from handlers.errors import ClientError


def decode_digit(value: str) -> int:
    if not value.isdigit():
        raise ClientError(400, "NotADigit", f"{value!r} is not a digit")
    return int(value)


def test_client_errors_stay_at_their_own_index():
    rows = ["1", "x", "3", "y"]
    batch = decode_each(len(rows), lambda index: decode_digit(rows[index]))
    assert batch.items == [1, 3] and batch.indices == [0, 2]
    assert sorted(batch.errors) == [1, 3]
    outcomes = merge_outcomes(len(rows), batch.indices, [10, 30], batch.errors)
    assert outcomes[0] == 10 and outcomes[2] == 30
    assert isinstance(outcomes[1], ClientError) and isinstance(outcomes[3], ClientError)


def test_a_server_fault_is_not_turned_into_a_client_error():
    def broken(index: int) -> int:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError, match="bug"):
        decode_each(2, broken)


def test_answers_must_cover_every_decoded_request():
    with pytest.raises(ValueError):
        merge_outcomes(2, [0, 1], ["only one"], {})


def test_client_error_rejects_non_4xx_statuses():
    with pytest.raises(ValueError):
        ClientError(500, "Oops", "server faults are not client errors")
