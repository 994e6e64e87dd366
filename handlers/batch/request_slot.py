"""One request of a batch, as one object: what it asked, what it became, how it was answered.

`handle` (handlers.serving) makes one `RequestSlot` per request and runs stages over the slots:
the protocol reads the row, the handler parses it once into a `ParsedRequest` (its encoded
images and a frozen options dataclass of its kind), the cache may answer it, the handler decodes
it into `DecodedImage`s and the model answers them. A slot is settled exactly once: an answer or a
ClientError; nothing is tracked by position in parallel lists.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from handlers.ground.decoded_requests import ParsedRequest
from handlers.ground.errors import ClientError
from handlers.request.inference_protocol import V2Request

HeaderReader = Callable[[str], "str | None"]


@dataclass(eq=False)
class RequestSlot:
    """One request of a batch through every stage. `context` is the TorchServe context its
    answer goes to, at `index` (in continuous batching, each request has its own context; see
    handlers.continuous_batching). `row` is what TorchServe handed over (a v2 request's row once
    the protocol has read it); `v2` is set for an Open Inference Protocol request; `decoded`
    holds one DecodedImage per image; `cache_keys` are the exact key and, in near-duplicate
    mode, the perceptual one (single-image requests only)."""

    index: int
    row: Mapping[str, Any]
    header: HeaderReader
    context: Any = None         # a handlers.torchserve_context.TorchServeContext
    v2: V2Request | None = None
    parsed: ParsedRequest[Any] | None = None
    decoded: list[Any] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)   # each decoded image's ImageHeader
    answer_json: bytes | None = None   # the answer serialised, once (`answer_bytes`)
    cache_status: str | None = None
    cache_keys: list[str] = field(default_factory=list)
    answer: Any = None
    error: ClientError | None = None
    settled: bool = False

    @property
    def several(self) -> bool:
        """It asked for several images (see ParsedRequest): its answer is a list."""
        return self.parsed is not None and self.parsed.several

    @property
    def is_open(self) -> bool:
        """Still to be answered: neither refused nor answered yet."""
        return not self.settled

    def refuse(self, error: ClientError) -> None:
        self._settle()
        self.error = error

    def answer_with(self, answer: Any, serialised: bytes | None = None) -> None:
        """Settle the request with `answer`; `serialised` is its JSON when the caller has it
        already (a cache hit's stored bytes)."""
        self._settle()
        self.answer, self.answer_json = answer, serialised

    def answer_bytes(self) -> bytes:
        """The answer as JSON, serialised once: the body of a /predictions answer and what the
        response cache stores are the same bytes."""
        if self.answer_json is None:
            self.answer_json = json.dumps(self.answer).encode("utf-8")
        return self.answer_json

    def _settle(self) -> None:
        if self.settled:
            raise ValueError(f"request {self.index} is answered twice")
        self.settled = True


def open_slots(slots: Sequence[RequestSlot]) -> list[RequestSlot]:
    return [slot for slot in slots if slot.is_open]


def computed_images(slots: Sequence[RequestSlot]) -> Iterator[tuple[bytes, Any, Any, Any]]:
    """(encoded bytes, ImageHeader or None, DecodedImage, answer) of every image of the answered,
    decoded requests of `slots` (not cache hits, not refused ones): what drift counting and
    payload sampling see. The header is the one the image was decoded by (None from a handler
    that decodes without one)."""
    for slot in slots:
        if slot.error is not None or not slot.decoded or slot.parsed is None:
            continue
        answers = slot.answer if slot.several else [slot.answer]
        headers = slot.headers or [None] * len(slot.decoded)
        yield from zip(slot.parsed.images, headers, slot.decoded, answers, strict=True)
