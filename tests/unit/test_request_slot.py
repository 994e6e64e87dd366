"""The batch contract of `handle`, with a tiny handler that needs no model: every request gets
exactly one outcome at its own index; a ClientError stays with its request; a server fault
fails the batch."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from handlers.batch.request_slot import RequestSlot
from handlers.continuous_serving import ContinuousServing
from handlers.ground.decoded_requests import DecodedImage, ParsedRequest
from handlers.ground.errors import ClientError
from handlers.model.settings import ContinuousBatching
from handlers.serving import BatchedImageHandler, HeaderReader
from handlers.shadow.answer_comparison import AnswerComparison
from torchserve_vision.local_handler import LocalContext


class DigitHandler(BatchedImageHandler[int, list[int], list[int], Any]):
    """Requests are text digits; the answer is ten times the digit."""

    def __init__(self, answers_dropped: int = 0) -> None:
        super().__init__()
        self.precision, self.answers_dropped, self.decoded = "fp32", answers_dropped, 0
        self.max_batch_size = 8

    def parse_settings(self, handler_section: Mapping[str, Any]) -> Any:
        return None

    def load(self, serialized_file: str | None) -> None:
        pass

    def parse_request(self, row: Mapping[str, Any], header: HeaderReader) -> ParsedRequest[int]:
        text = bytes(row["body"]).decode()
        if text == "boom":
            raise RuntimeError("a bug")
        return ParsedRequest((bytes(row["body"]),), self.parse_options(row, header))

    def parse_options(self, row: Mapping[str, Any], header: HeaderReader) -> int:
        text = bytes(row["body"]).decode()
        if not text.isdigit():
            raise ClientError(400, "NotADigit", f"{text!r} is not a digit")
        return int(text)

    def decode_images(self, encoded: Sequence[bytes]) -> list[tuple[torch.Tensor | ClientError, Any]]:
        self.decoded += len(encoded)
        return [(torch.empty(0), None) for _ in encoded]

    def preprocess(self, items: Sequence[DecodedImage[int]]) -> list[int]:
        return [item.options for item in items]

    def infer(self, model_input: list[int]) -> list[int]:
        return [value * 10 for value in model_input]

    def postprocess(self, model_output: list[int], model_input: list[int],
                    items: Sequence[DecodedImage[int]]) -> list[Any]:
        return model_output[self.answers_dropped:]

    def warm_up(self, batch_size: int) -> None:
        pass

    def v2_outputs(self, answer: Any) -> list[dict[str, Any]]:
        return []

    def v2_output_specs(self) -> tuple[()]:
        return ()

    def compare_answers(self, production: Any, candidate: Any) -> AnswerComparison:
        return AnswerComparison(float(production == candidate))


def handle(handler: DigitHandler, bodies: list[str]) -> tuple[list[Any], LocalContext]:
    context = LocalContext(".", {}, {})
    rows = [{"body": bytearray(body.encode())} for body in bodies]
    return [json.loads(body) for body in handler.handle(rows, context)], context


def test_client_errors_stay_at_their_own_index():
    handler = DigitHandler()
    answers, context = handle(handler, ["1", "x", "3", "y"])
    assert answers[0] == 10 and answers[2] == 30
    assert [answers[i]["type"] for i in (1, 3)] == ["NotADigit", "NotADigit"]
    assert [context.status(i) for i in range(4)] == [200, 400, 200, 400]
    assert handler.decoded == 2     # refused requests are never decoded


def test_a_server_fault_is_not_turned_into_a_client_error():
    with pytest.raises(RuntimeError, match="a bug"):
        handle(DigitHandler(), ["1", "boom"])


def test_answers_must_cover_every_decoded_request():
    with pytest.raises(ValueError, match="1 answers for 2 images"):
        handle(DigitHandler(answers_dropped=1), ["1", "2"])


def test_a_request_is_settled_once():
    slot = RequestSlot(0, {}, lambda name: None)
    slot.answer_with([1])
    assert not slot.is_open
    with pytest.raises(ValueError, match="answered twice"):
        slot.refuse(ClientError(400, "Late", "too late"))


def test_client_error_rejects_non_4xx_statuses():
    with pytest.raises(ValueError):
        ClientError(500, "Oops", "server faults are not client errors")


# --- continuous batching (TorchServe's asynchronous worker mode) ---------------------------------
class GatedDigitHandler(DigitHandler):
    """Its model waits for the gate, so a test can hold a batch while more requests arrive."""

    def __init__(self, max_batch_size: int, max_queued: int) -> None:
        super().__init__()
        self.gate, self.running = threading.Event(), threading.Event()
        self.continuous = ContinuousServing(self.run_slots, self.describe,
                                            ContinuousBatching(max_queued, max_batch_size), "digits 1")

    def infer(self, model_input: list[int]) -> list[int]:
        self.running.set()
        self.gate.wait(30)
        return super().infer(model_input)


async def handle_continuously(handler: DigitHandler, body: str) -> tuple[Any, LocalContext]:
    context = LocalContext(".", {}, {})
    (answer,) = await handler.handle([{"body": bytearray(body.encode())}], context)
    return json.loads(answer), context


def test_continuous_mode_batches_what_arrived_and_refuses_a_full_queue_at_once():
    async def scenario() -> None:
        handler = GatedDigitHandler(max_batch_size=2, max_queued=2)
        first = asyncio.ensure_future(handle_continuously(handler, "1"))
        while not handler.running.is_set():       # the first request runs alone, at once
            await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(handle_continuously(handler, text)) for text in ("2", "x")]
        while handler.continuous is not None and handler.continuous.batcher.queued < 2:
            await asyncio.sleep(0.01)
        refused, context = await handle_continuously(handler, "4")
        assert context.status(0) == 503 and refused["type"] == "ServiceUnavailable"
        assert context.response_headers[0]["Retry-After"] == "1"
        handler.gate.set()
        (one, one_context), (two, _), (bad, bad_context) = [await task for task in (first, *queued)]
        assert (one, one_context.response_headers[0]["X-Batch-Size"]) == (10, "1")
        assert two == 20 and (bad_context.status(0), bad["type"]) == (400, "NotADigit")

    asyncio.run(scenario())


def test_continuous_mode_answers_a_server_fault_per_request_with_500():
    async def scenario() -> None:
        handler = GatedDigitHandler(max_batch_size=4, max_queued=4)
        handler.gate.set()
        answer, context = await handle_continuously(handler, "boom")
        assert context.status(0) == 500 and answer["type"] == "ServerFault" and "a bug" in answer["message"]
        answer, context = await handle_continuously(handler, "3")      # the worker goes on
        assert (answer, context.status(0)) == (30, 200)

    asyncio.run(scenario())
