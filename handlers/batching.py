"""Split a batch into the requests that decoded and those that failed, and put answers back in order.

Contract: every request of a batch gets exactly one outcome, at its own index; a ClientError in
one request never changes another request's answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from handlers.errors import ClientError

Item = TypeVar("Item")
Answer = TypeVar("Answer")


@dataclass
class DecodedBatch(Generic[Item]):
    """The decoded requests (`items`, at batch positions `indices`) and the refused ones."""

    items: list[Item] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    errors: dict[int, ClientError] = field(default_factory=dict)


def decode_each(
    size: int, decode_request: Callable[[int], Item]
) -> DecodedBatch[Item]:
    """Call `decode_request(index)` for each of `size` requests; a ClientError is kept for that
    index alone. Any other exception is a server fault and propagates (it fails the batch)."""
    batch: DecodedBatch[Item] = DecodedBatch()
    for index in range(size):
        try:
            item = decode_request(index)
        except ClientError as error:
            batch.errors[index] = error
            continue
        batch.items.append(item)
        batch.indices.append(index)
    return batch


def merge_outcomes(
    size: int, indices: Sequence[int], answers: Sequence[Answer], errors: dict[int, ClientError]
) -> list[Answer | ClientError]:
    """One outcome per request, in batch order: its answer, or its ClientError.

    Raises ValueError if the answers do not cover exactly the requests that were not refused.
    """
    if len(indices) != len(answers):
        raise ValueError(f"{len(answers)} answers for {len(indices)} decoded requests")
    outcomes: dict[int, Answer | ClientError] = dict(errors)
    outcomes.update(zip(indices, answers, strict=True))
    if sorted(outcomes) != list(range(size)):
        raise ValueError(f"outcomes cover {sorted(outcomes)}, expected 0..{size - 1}")
    return [outcomes[index] for index in range(size)]
