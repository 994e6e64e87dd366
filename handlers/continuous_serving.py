"""TorchServe's asynchronous worker mode (`asyncCommunication: true` in the archive's YAML), as
the handler's front: each request joins the continuous batcher (handlers.continuous_batching)
and its answer is awaited on TorchServe's event loop while the batch runs on the batcher's
thread. A full queue is answered 503 with Retry-After at once; a failed batch is answered 500
per request.

Workarounds for TorchServe 0.12 (its last release) in this mode:
- its asynchronous frontend fails on batches of more than one request (AsyncBatchAggregator
  removes from the map it iterates: ConcurrentModificationException, and the worker never
  recovers), so the model is registered with batch size 1 and the worker batches itself;
- a message answered with a non-200 code sends that error to every request the worker holds,
  so a server fault is answered per request inside a 200 message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from handlers.batch.request_slot import RequestSlot
from handlers.batch_metrics import emit_queue_full
from handlers.continuous_batching import ContinuousBatcher, QueueFull
from handlers.model.settings import ContinuousBatching, parse_continuous_batching
from handlers.torchserve_context import (
    JSON_CONTENT_TYPE,
    TorchServeContext,
    header_reader,
    is_describe_request,
)

logger = logging.getLogger(__name__)
HTTP_SERVER_PHRASES = {500: "Internal Server Error", 503: "Service Unavailable"}


def continuous_batching_of(handler_settings: Mapping[str, Any],
                           registered_batch_size: int) -> ContinuousBatching:
    """The worker's continuous-batching settings; ValueError unless the model is registered
    with batch size 1 (see the module docstring)."""
    if registered_batch_size != 1:
        raise ValueError(f"asynchronous worker mode: register the model with batch_size 1 (it is "
                         f"{registered_batch_size}); continuous_batching.max_batch_size sets the "
                         "worker's batches")
    return parse_continuous_batching(handler_settings) or ContinuousBatching()


def server_fault(slot: RequestSlot, error_type: str, message: str, status: int) -> bytes:
    """A 5xx for one request, with a JSON body shaped like a ClientError's."""
    context, index = slot.context, slot.index
    context.set_response_content_type(index, JSON_CONTENT_TYPE)
    context.set_response_status(status, HTTP_SERVER_PHRASES[status], index)
    return json.dumps({"code": status, "type": error_type, "message": message}).encode("utf-8")


class ContinuousServing:
    """`run_slots`: the handler's batch path (one body per slot); `describe`: its answer to
    TorchServe's describe job; `name`: the model and version, for messages."""

    def __init__(self, run_slots: Callable[[Sequence[RequestSlot]], list[bytes]],
                 describe: Callable[[], dict[str, Any]], settings: ContinuousBatching,
                 name: str) -> None:
        self.describe, self.name = describe, name
        self.batcher: ContinuousBatcher[RequestSlot, bytes] = ContinuousBatcher(
            run_slots, settings.max_batch_size, settings.max_queued, name=f"batcher {name}")
        logger.info("continuous batching: max_batch_size=%d max_queued=%d",
                    settings.max_batch_size, settings.max_queued)

    async def handle(self, data: Sequence[Mapping[str, Any]],
                     context: TorchServeContext) -> list[bytes]:
        if is_describe_request(data, context):
            return [json.dumps(self.describe()).encode("utf-8")]
        answers: list[Awaitable[bytes]] = []
        for index, row in enumerate(data):
            slot = RequestSlot(index, row, header_reader(context, index), context)
            try:
                answers.append(self.answer_when_batched(slot, self.batcher.submit(slot)))
            except QueueFull:
                answers.append(asyncio.sleep(0, self.refuse_overloaded(slot)))
        return list(await asyncio.gather(*answers))

    async def answer_when_batched(self, slot: RequestSlot, answer: Future[bytes]) -> bytes:
        try:
            return await asyncio.wrap_future(answer)
        except Exception as error:
            logger.error("batch failed: %s", error, exc_info=error)
            return server_fault(slot, "ServerFault", f"{type(error).__name__}: {error}", 500)

    def refuse_overloaded(self, slot: RequestSlot) -> bytes:
        emit_queue_full(slot.context.metrics)
        slot.context.set_response_header(slot.index, "Retry-After", "1")
        return server_fault(slot, "ServiceUnavailable", f"{self.name} has "
                            f"{self.batcher.max_queued} requests waiting; retry later", 503)
